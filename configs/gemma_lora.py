r"""Gemma 3 4B LoRA fine-tuning (gemma's `examples/lora.py`) with kd_ckpt.

Same experiment as gemma's `examples/lora.py` (v4): `Gemma3_4B` wrapped in
`gm.nn.LoRA(rank=4)`, pretrained weights loaded with
`SkipLoRA(LoadCheckpoint(GEMMA3_4B_IT))`, adafactor on the LoRA weights only,
MTNT en->fr seq2seq data, a sampler evaluator and a checkpoint every 500
steps.  The only change: the checkpointer is `kd_ckpt.SafeCheckpointer`, which
keeps each save inside a host-RAM budget.

Train (needs the Gemma weights, the tokenizer and MTNT: network access):

```sh
python -m kauldron.main \
    --cfg=configs/gemma_lora.py \
    --cfg.workdir=/tmp/gemma_lora
```

Flags (`ConfigArgs`, set with `--cfg.__args__.<name>=<value>`):

* `safe_ckpt=False`: stock `kd.ckpts.Checkpointer` (to compare).
* `host_ram_budget='8GiB'`: the budget (default `'auto'`: a fraction of the
  host's available RAM, see `kd_ckpt.AUTO_FRACTION`).
* `strategy='stream'`: force a save strategy (default `'auto'`).
* `tiny=True`: a dummy Gemma and synthetic pre-tokenized data, 4 steps, a
  checkpoint every 2 steps; runs offline on CPU in seconds:

```sh
python -m kauldron.main \
    --cfg=configs/gemma_lora.py \
    --cfg.workdir=/tmp/gemma_lora_tiny \
    --cfg.__args__.tiny=True
```

Preflight of a save without allocating anything (abstract train state):

```sh
python -m kd_ckpt plan --cfg=configs/gemma_lora.py --host-ram-budget=16GiB
```
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kauldron import konfig

# pylint: disable=g-import-not-at-top
with konfig.imports():
  from gemma import gm
  from kauldron import kd
  import kd_ckpt
  import optax
# pylint: enable=g-import-not-at-top


@dataclasses.dataclass(frozen=True)
class ConfigArgs:
  """Flags of this config (`--cfg.__args__.<name>=<value>`)."""

  safe_ckpt: bool = True
  host_ram_budget: str = "auto"
  strategy: str = "auto"
  tiny: bool = False


# The tiny variant: small enough to train on 2 CPU cores in seconds, large
# enough to exercise a sharded save.  The batch is 8 so that it divides both 1
# device and the 8 fake CPU devices the tests use.
_TINY_BATCH_SIZE = 8
_TINY_MAX_LENGTH = 16
_TINY_NUM_TRAIN_STEPS = 4
_TINY_SAVE_INTERVAL_STEPS = 2
# `gm.testing.DummyGemma` has a vocabulary of 13 tokens.
_TINY_VOCAB_SIZE = 13


def get_config(args: ConfigArgs = ConfigArgs()):
  """The trainer config."""
  if args.tiny:
    batch_size = _TINY_BATCH_SIZE
    num_train_steps = _TINY_NUM_TRAIN_STEPS
    save_interval_steps = _TINY_SAVE_INTERVAL_STEPS
  else:
    batch_size = 16
    num_train_steps = 10_000
    save_interval_steps = 500
  max_length = 512

  if args.tiny:
    model = gm.nn.LoRA(
        rank=4,
        model=gm.testing.DummyGemma(tokens="batch.input"),
    )
    # No pretrained weights offline: start from the random init.
    init_transform = kd.ckpts.NoopTransform()
    train_ds = _make_tiny_dataset(batch_size=batch_size)
    evals = {}
  else:
    model = gm.nn.LoRA(
        rank=4,
        model=gm.nn.Gemma3_4B(
            tokens="batch.input",
            # LoRA fine-tuning with multimodal is not supported by gemma yet.
            text_only=True,
        ),
    )
    # Load the weights from the pretrained checkpoint.  `SkipLoRA`: the
    # original checkpoint does not contain the LoRA weights.
    init_transform = gm.ckpts.SkipLoRA(
        wrapped=gm.ckpts.LoadCheckpoint(
            path=gm.ckpts.CheckpointPath.GEMMA3_4B_IT,
        )
    )
    train_ds = _make_dataset(
        training=True,
        batch_size=batch_size,
        max_length=max_length,
    )
    evals = {
        "test": kd.evals.Evaluator(
            run=kd.evals.EveryNSteps(1000),
            ds=_make_dataset(
                training=False,
                batch_size=batch_size,
                max_length=max_length,
            ),
        ),
        # Inference on a few prompts from the test set.
        "sampling": gm.evals.SamplerEvaluator(
            run=kd.evals.EveryNSteps(1000),
            max_new_tokens=150,
            num_examples=1,
            ds=_make_dataset(training=False, sampling=True),
        ),
    }

  return kd.train.Trainer(
      seed=42,
      train_ds=train_ds,
      model=model,
      init_transform=init_transform,
      num_train_steps=num_train_steps,
      train_losses={
          "xentropy": kd.losses.SoftmaxCrossEntropyWithIntLabels(
              logits="preds.logits",
              labels="batch.target",
              mask="batch.loss_mask",
          ),
      },
      # Only the LoRA weights are trained; the rest of the model is frozen.
      optimizer=kd.optim.partial_updates(
          optax.adafactor(learning_rate=0.005),
          mask=kd.optim.select("lora"),
      ),
      checkpointer=_make_checkpointer(args, save_interval_steps),
      evals=evals,
  )


def _make_checkpointer(args: ConfigArgs, save_interval_steps: int):
  if args.safe_ckpt:
    return kd_ckpt.SafeCheckpointer(
        save_interval_steps=save_interval_steps,
        host_ram_budget=args.host_ram_budget,
        strategy=args.strategy,
    )
  return kd.ckpts.Checkpointer(save_interval_steps=save_interval_steps)


def _make_dataset(
    *,
    training: bool,
    sampling: bool = False,
    batch_size: int | None = None,
    max_length: int | None = None,
):
  """MTNT en->fr, tokenized for seq2seq (as in gemma's examples/lora.py)."""
  tokenizer = gm.text.Gemma3Tokenizer()

  return kd.data.py.Tfds(
      name="mtnt/en-fr",
      split="train" if training else "test",
      shuffle=True if training else False,
      num_epochs=None if training else 1,
      batch_size=None if sampling else batch_size,
      num_workers=4,
      transforms=[
          # Output batch is {"input": ..., "target": ..., "loss_mask": ...}
          gm.data.Seq2SeqTask(
              in_prompt="src",
              in_response="dst",
              out_input="input",
              out_target="target",
              out_target_mask="loss_mask",
              tokenizer=tokenizer,
              max_length=None if sampling else max_length,
              # ~1% of the examples are longer than 512 tokens.
              truncate=True,
              sampling=sampling,
          ),
      ],
  )


def _make_tiny_dataset(*, batch_size: int):
  """Synthetic pre-tokenized examples with the fields `Seq2SeqTask` outputs."""
  return kd.data.py.DataSource(
      data_source=SyntheticSeq2Seq(
          num_examples=8 * batch_size,
          max_length=_TINY_MAX_LENGTH,
          vocab_size=_TINY_VOCAB_SIZE,
      ),
      shuffle=True,
      num_epochs=None,
      batch_size=batch_size,
      # In-process: the data source is defined in this config file, which
      # grain worker processes could not import.
      num_workers=0,
  )


@dataclasses.dataclass(frozen=True)
class SyntheticSeq2Seq:
  """In-memory random-access source of fake token sequences (grain protocol).

  Each example is deterministic in its index, so a resumed run sees the same
  data as an uninterrupted one.
  """

  num_examples: int
  max_length: int
  vocab_size: int

  def __len__(self) -> int:
    return self.num_examples

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(index)
    tokens = rng.integers(1, self.vocab_size, size=self.max_length + 1)
    # Loss on the second half only, like a prompt/response pair.
    loss_mask = np.arange(self.max_length) >= self.max_length // 2
    return {
        "input": tokens[:-1].astype(np.int32),
        "target": tokens[1:, None].astype(np.int32),
        "loss_mask": loss_mask[:, None],
    }
