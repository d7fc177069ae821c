"""A bucket's network on loopback: a TCP proxy that delays requests and caps each connection.

fake-gcs-server on 127.0.0.1 answers in microseconds, at memory speed, so a
restore that sends one request at a time looks as fast there as one that
keeps many in flight.  A real bucket takes tens of milliseconds to answer
each request and serves each connection at a few hundred MB/s.  This proxy
puts both in between: every byte a client sends reaches the server
`latency_secs` later (so each request waits that long before the server sees
it), and each connection's responses flow at most `rate_bytes_per_sec`.

It also counts connections and requests, and samples how many connections
carry response bytes at once (`busy`).

Example:

  with SlowLink(server_port, latency_secs=0.02, rate_bytes_per_sec=200e6) as link:
    env['TENSORSTORE_GCS_HTTP_URL'] = f'http://127.0.0.1:{link.port}'
    ...  # restores through the link
    print(link.connections, link.requests)
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time

CHUNK_BYTES = 1 << 16
SAMPLE_SECS = 0.1


class SlowLink:
  """127.0.0.1:`port` forwards to 127.0.0.1:`target_port`, slowly."""

  def __init__(self, target_port: int, *, latency_secs: float = 0.02,
               rate_bytes_per_sec: float = 200e6):
    self.target_port = target_port
    self.latency_secs = latency_secs
    self.rate_bytes_per_sec = rate_bytes_per_sec
    self.connections = 0
    self.requests = 0
    self.down_bytes = 0
    # Each request's method and target ('GET /storage/v1/b/...'), in order.
    self.request_lines: list[str] = []
    self.request_times: list[float] = []  # time.time() of each of request_lines
    # Samples (every SAMPLE_SECS while bytes flow): connections that carried
    # response bytes in the sample -> how many samples.
    self.busy: collections.Counter = collections.Counter()
    self._active: set = set()
    self._loop = asyncio.new_event_loop()
    self._stop = threading.Event()
    ready = threading.Event()

    def serve():
      asyncio.set_event_loop(self._loop)

      async def start():
        self._server = await asyncio.start_server(self._handle, '127.0.0.1', 0)
        self.port = self._server.sockets[0].getsockname()[1]
        ready.set()

      self._loop.run_until_complete(start())
      self._loop.run_forever()

    self._thread = threading.Thread(target=serve, daemon=True, name='slow-link')
    self._thread.start()
    ready.wait()
    self._sampler = threading.Thread(target=self._sample, daemon=True, name='slow-link-sample')
    self._sampler.start()

  def __enter__(self) -> 'SlowLink':
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def reset_counts(self) -> None:
    self.connections = self.requests = self.down_bytes = 0
    self.busy = collections.Counter()
    self.request_lines = []
    self.request_times = []  # time.time() of each of request_lines

  def _sample(self) -> None:
    while not self._stop.is_set():
      self._active, before = set(), self.down_bytes
      time.sleep(SAMPLE_SECS)
      if self.down_bytes > before:
        self.busy[len(self._active)] += 1

  async def _handle(self, client_r, client_w) -> None:
    try:
      await self._serve(client_r, client_w)
    except asyncio.CancelledError:
      client_w.close()  # the link is closing (`close`): not an error to log

  async def _serve(self, client_r, client_w) -> None:
    self.connections += 1
    try:
      server_r, server_w = await asyncio.open_connection('127.0.0.1', self.target_port)
    except OSError:
      client_w.close()
      return
    loop = asyncio.get_running_loop()

    async def up():
      # Each chunk is written `latency_secs` after it arrived, in order.
      try:
        while data := await client_r.read(CHUNK_BYTES):
          self.requests += data.count(b' HTTP/1.1\r\n')
          now = time.time()
          for line in data.split(b'\r\n'):
            if line.endswith(b' HTTP/1.1'):
              self.request_lines.append(line.rsplit(b' ', 1)[0].decode('latin-1'))
              self.request_times.append(now)
          loop.call_at(loop.time() + self.latency_secs, server_w.write, data)
        await asyncio.sleep(self.latency_secs)
        server_w.write_eof()
      except (OSError, RuntimeError):
        pass

    async def down():
      free_at = 0.0  # when this connection may send again
      try:
        while data := await server_r.read(CHUNK_BYTES):
          now = loop.time()
          free_at = max(free_at, now) + len(data) / self.rate_bytes_per_sec
          if free_at - now > 1e-3:
            await asyncio.sleep(free_at - now)
          self.down_bytes += len(data)
          self._active.add(id(client_w))
          client_w.write(data)
          await client_w.drain()
      except (OSError, RuntimeError):
        pass
      finally:
        client_w.close()

    await asyncio.gather(up(), down())
    server_w.close()

  def close(self) -> None:
    self._stop.set()

    async def stop():
      self._server.close()
      tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
      for t in tasks:
        t.cancel()
      await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout=10)
    self._loop.call_soon_threadsafe(self._loop.stop)
    self._thread.join(timeout=10)
