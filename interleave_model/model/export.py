"""Turn a training checkpoint into a folder that `from_pretrained` loads: a HF model, or a peft adapter under LoRA.

```
python cli.py export --config configs/demo.yaml --ckpt_path lightning_logs/demo/version_0/checkpoints/last.ckpt \
    --output_dir exported/demo [--merge_lora true]
```

The config rebuilds the module (the same model, tiny shape, LoRA settings and corpus as in training), the checkpoint
fills its weights, and the policy is saved with its tokenizer:

- without LoRA: a model folder, ``AutoModelForCausalLM.from_pretrained(output_dir)``;
- with LoRA: an adapter folder, ``AutoPeftModelForCausalLM.from_pretrained(output_dir)`` (the adapter config names
  the base model's path; the embedded tiny model has none, so its base is saved in ``output_dir/base_model`` and
  named by absolute path, as is a local base folder); ``merge_lora`` saves the merged weights as a plain model
  folder instead.

``export.json`` records the checkpoint and the step it came from.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import torch
from lightning.pytorch.utilities import rank_zero_info

from interleave_data.atomic import replacing_dir
from interleave_model.model.checkpoint import load_checkpoint_weights, safe_load
from interleave_model.model.policy import TINY, is_peft

BASE_MODEL_DIR = "base_model"


def load_weights(module: torch.nn.Module, ckpt_path: str | os.PathLike) -> dict:
    """Load a Lightning checkpoint's weights into `module`; returns the checkpoint.

    Every key must fit; only a LoRA checkpoint may lack the frozen base, which the module loaded from disk
    (`checkpoint.load_checkpoint_weights`, as for `--model.base.init_from`).

    The checkpoint is read with `checkpoint.safe_load`: tensors and the project's settings, never code.

    Raises:
        PolicyError: When the weights do not fit `module`.
    """
    checkpoint = safe_load(ckpt_path, "--ckpt_path")
    module.on_load_checkpoint(checkpoint)  # creates the frozen reference if the checkpoint has one
    load_checkpoint_weights(module, checkpoint, str(ckpt_path))
    return checkpoint


def export(module, output_dir: str | os.PathLike, merge_lora: bool = False, source: dict | None = None) -> Path:
    """Save `module.policy` and `module.tokenizer` so that `from_pretrained` loads them (see the module doc).

    Args:
        module: An `InterleaveGRPO` (anything with `policy`, `tokenizer` and `hparams`).
        output_dir: Folder to write: written beside it and swapped in whole (`atomic.replacing_dir`), so a reader
            or a killed run never sees half an export. An existing folder is replaced only if it is empty or an
            earlier export (it has ``export.json``).
        merge_lora: Under LoRA, save the base with the adapter merged in, as a plain model folder.
        source: Provenance written to ``export.json`` (e.g. the checkpoint path and step).

    Returns:
        The output folder.

    Raises:
        FileExistsError: `output_dir` holds files and is not an earlier export.
    """
    final = Path(output_dir).absolute()
    with replacing_dir(final, lambda folder: (folder / "export.json").is_file()) as out:
        _write(module, out, final, merge_lora, source)
    rank_zero_info(f"exported to {final}")
    return final


def _write(module, out: Path, final: Path, merge_lora: bool, source: dict | None) -> None:
    """Write the export into `out`; paths inside it that name the folder use `final`, where it will live."""
    policy = module.policy
    if is_peft(policy) and merge_lora:
        copy.deepcopy(policy).merge_and_unload().save_pretrained(out)
    elif is_peft(policy):
        policy.save_pretrained(out)
        base = module.model_path  # a shipped model's name resolved to its cached folder
        if base == TINY:  # an in-memory base: save it and point the adapter at it
            copy.deepcopy(policy).unload().save_pretrained(out / BASE_MODEL_DIR)
            module.tokenizer.save_pretrained(out / BASE_MODEL_DIR)
            _set_base_model(out, final / BASE_MODEL_DIR)
        elif os.path.isdir(base):  # a relative path would name the base only from the training run's folder
            _set_base_model(out, Path(base).absolute())
    else:
        policy.save_pretrained(out)
    module.tokenizer.save_pretrained(out)
    info = {"model_name_or_path": module.base.name_or_path, "lora": is_peft(policy) and not merge_lora}
    (out / "export.json").write_text(json.dumps(info | (source or {}), indent=2, default=str) + "\n")


def _set_base_model(adapter_dir: Path, base_dir: Path) -> None:
    path = adapter_dir / "adapter_config.json"
    config = json.loads(path.read_text())
    config["base_model_name_or_path"] = str(base_dir)
    path.write_text(json.dumps(config, indent=2) + "\n")
