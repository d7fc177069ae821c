"""`python -m kd_ckpt plan|inspect`: see `kd_ckpt.cli`."""

import os
import sys

from kd_ckpt import cli

if __name__ == '__main__':
  try:
    code = cli.main()
    sys.stdout.flush()
  except BrokenPipeError:
    # Output piped into `head` & co.: stop quietly, as Unix tools do.
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    code = 0
  sys.exit(code)
