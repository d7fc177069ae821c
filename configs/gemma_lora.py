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
* `strategy='streaming'` (or `'orbax'`): force a save strategy (default
  `'auto'`: the fastest that fits the budget).
* `reuse_unchanged=False`: write every leaf at every save.  By default (True)
  a save takes the frozen Gemma weights, unchanged since the previous
  checkpoint, by reference (hard links) and writes only the LoRA weights and
  their optimizer state; every checkpoint stays a complete Orbax checkpoint.
* `pretrained='/path/ckpt'`: the Gemma checkpoint to start from (default:
  `GEMMA3_4B_IT`; with `tiny`, none: the random init).  With `safe_ckpt`
  it is loaded within `host_ram_budget` too (`kd_ckpt.InitWithinBudget`):
  Gemma's loader reads it through kd_ckpt's reader.
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

from kauldron import konfig

# pylint: disable=g-import-not-at-top
with konfig.imports():
  from gemma import gm
  from kauldron import kd
  import kd_ckpt
  import numpy as np
  import optax
# pylint: enable=g-import-not-at-top


@dataclasses.dataclass(frozen=True)
class ConfigArgs:
  """Flags of this config (`--cfg.__args__.<name>=<value>`).

  Attributes:
    safe_ckpt: `kd_ckpt.SafeCheckpointer` (True) or the stock
      `kd.ckpts.Checkpointer` (False), same schedule.
    host_ram_budget: extra host RAM a save may add ("auto", "16GiB", bytes,
      or a fraction of the available RAM in (0, 1]).
    strategy: "auto", "orbax" or "streaming".
    reuse_unchanged: reuse the leaves that did not change since the previous
      checkpoint (the frozen weights) instead of writing them again.
    pretrained: the Gemma checkpoint (stock Orbax, e.g. `gm.ckpts.CheckpointPath`)
      to load the weights from; "" for the default (GEMMA3_4B_IT, or none
      with `tiny`).
    tiny: dummy Gemma + synthetic tokens, 4 steps, a save every 2 (offline).
  """

  safe_ckpt: bool = True
  host_ram_budget: str | float = "auto"
  strategy: str = "auto"
  reuse_unchanged: bool = True
  pretrained: str = ""
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
_TINY_NUM_EXAMPLES = 16  # Repeated: the data only has to be valid.


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
            num_batches=1,  # A single example (the dataset is unbatched).
            ds=_make_dataset(training=False, sampling=True),
        ),
    }

  return kd.train.Trainer(
      seed=42,
      train_ds=train_ds,
      model=model,
      init_transform=_make_init_transform(args),
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


def _make_init_transform(args: ConfigArgs):
  """The pretrained weights: Gemma's loader, within the budget with kd_ckpt."""
  path = args.pretrained or (None if args.tiny else gm.ckpts.CheckpointPath.GEMMA3_4B_IT)
  if path is None:
    # No pretrained weights offline: start from the random init.
    return kd.ckpts.NoopTransform()
  # `SkipLoRA`: the original checkpoint does not contain the LoRA weights.
  load = gm.ckpts.SkipLoRA(wrapped=gm.ckpts.LoadCheckpoint(path=path))
  if args.safe_ckpt:
    # Gemma's loader reads through its own StandardCheckpointer: with Orbax's
    # reader a stock checkpoint can take as much host RAM again as the
    # weights, before the first step.
    return kd_ckpt.InitWithinBudget(wrapped=load, host_ram_budget=args.host_ram_budget)
  return load


def _make_checkpointer(args: ConfigArgs, save_interval_steps: int):
  if args.safe_ckpt:
    return kd_ckpt.SafeCheckpointer(
        save_interval_steps=save_interval_steps,
        host_ram_budget=args.host_ram_budget,
        strategy=args.strategy,
        reuse_unchanged=args.reuse_unchanged,
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
  """Synthetic pre-tokenized examples with the fields `Seq2SeqTask` outputs.

  `input` i32[L], `target` i32[L 1], `loss_mask` bool[L 1], kept in memory
  (a tuple of dicts is a valid grain random-access source).  The tokens are a
  fixed function of the example index, so a resumed run sees the same data.
  """
  examples = []
  for index in range(_TINY_NUM_EXAMPLES):
    tokens = _fake_tokens(index, _TINY_MAX_LENGTH + 1)
    examples.append({
        "input": np.asarray(tokens[:-1], dtype="int32"),
        "target": np.asarray([[t] for t in tokens[1:]], dtype="int32"),
        # Loss on the second half only, like a prompt/response pair.
        "loss_mask": np.asarray(
            [[j >= _TINY_MAX_LENGTH // 2] for j in range(_TINY_MAX_LENGTH)],
            dtype="bool",
        ),
    })
  return kd.data.py.DataSource(
      data_source=examples,
      shuffle=True,
      num_epochs=None,
      batch_size=batch_size,
      # In-process: nothing to parallelize, and no worker start-up cost.
      num_workers=0,
  )


def _fake_tokens(index: int, length: int) -> list[int]:
  """Deterministic tokens in [1, vocab) (0 is the padding id)."""
  state = index + 1
  tokens = []
  for _ in range(length):
    state = (state * 1103515245 + 12345) % 2**31  # an LCG: no RNG state.
    tokens.append(1 + state % (_TINY_VOCAB_SIZE - 1))
  return tokens
