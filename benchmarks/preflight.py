"""Seconds of the preflight at a run's start, first and second run, on a config's data. Prints one JSON line.

The config's `data` section is built once into a temporary cache (`data_s`, as a first `cli.py fit` builds it; the
data does not depend on the tokenizer). Then, per tokenizer, `preflight(module, datamodule)` runs twice as `fit` runs
it when it sets up: `first_s` with no token counts cached (every example tokenized), `second_s` reading them back (the
prompts formatted and hashed, the round trip of the target words checked again). `tiny` is the config's tiny model
(word-level tokenizer), `llama3` the Llama-3 test fixture (byte-level BPE, chat template; tests/families.py), built in
the temporary folder. `prompt_tokens` is the longest prompt of the longest length. TOKENIZERS_PARALLELISM is left as
the environment sets it, as `cli.py` does (unset: the Rust tokenizer may use every core).

    python benchmarks/preflight.py [--config configs/curriculum.yaml] [--tokenizers tiny llama3]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import harness
import tokenizers
from provenance import provenance

ROOT = Path(__file__).parents[1]


def datamodule(config: Path, cache_dir: str):
    """The config's data section as an `InterleaveDataModule`, built and set up, without a tokenizer yet."""
    import yaml

    from interleave_data.curriculum_types import CurriculumSettings
    from interleave_data.datamodule import InterleaveDataModule

    data = yaml.safe_load(config.read_text())["data"]
    data["curriculum"] = CurriculumSettings(**data.get("curriculum") or {})
    dm = InterleaveDataModule(**data, cache_dir=cache_dir)
    dm.prepare_data()
    dm.setup("fit")
    return dm


def module(name: str, config: Path, folder: Path):
    """The config's tiny model, or a family fixture built into `folder`, with the config's prompt template."""
    import yaml

    from interleave_model.module import InterleaveGRPO
    from interleave_model.settings.policy import Base, TinyModelConfig

    settings = yaml.safe_load(config.read_text())
    template = settings["data"].get("template", "two_processes")
    if name == "tiny":
        tiny = TinyModelConfig(**settings["model"]["tiny"])
        return InterleaveGRPO(base=Base(name_or_path="tiny"), template=template, tiny=tiny)
    return InterleaveGRPO(base=Base(name_or_path=harness.family_folder(name, folder / name)), template=template)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "curriculum.yaml")
    parser.add_argument("--tokenizers", nargs="+", default=["tiny", "llama3"], help="tiny, llama3, qwen2 or gpt2")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    from interleave_model.preflight.checks import lengths, preflight  # interleave_model before lightning, as cli.py

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        dm = datamodule(args.config, os.path.join(tmp, "cache"))
        data_s = time.perf_counter() - start
        for name in args.tokenizers:
            model = module(name, args.config, Path(tmp))
            model.policy.config.max_position_embeddings = 1 << 20  # the fixture's 2,048 would stop at 200 words
            dm.tokenizer = model.tokenizer
            seconds = []
            for _ in range(2):
                start = time.perf_counter()
                fits = preflight(model, dm)
                seconds.append(round(time.perf_counter() - start, 2))
            results[name] = {"first_s": seconds[0], "second_s": seconds[1], "prompt_tokens": fits[-1].prompt_tokens}
    report = {
        "benchmark": "preflight",
        "config": str(args.config.relative_to(ROOT) if args.config.is_relative_to(ROOT) else args.config),
        "lengths": lengths(dm),
        "examples": sum(len(dm.examples(n, split)) for n in lengths(dm) for split in ("train", "val", "test")),
        "data_s": round(data_s, 2),
        **results,
        **provenance(),
        "tokenizers": tokenizers.__version__,
        "tokenizers_parallelism": os.environ.get("TOKENIZERS_PARALLELISM"),
        "cpus": os.cpu_count(),
        "load_average": round(os.getloadavg()[0], 2),
    }
    harness.emit(report)
    return report


if __name__ == "__main__":
    main()
