"""Command line: `python cli.py {fit,validate,test,predict} --config configs/demo.yaml`."""

from __future__ import annotations

from lightning.pytorch.cli import LightningCLI

from interleave_data.datamodule import InterleaveDataModule
from interleave_model.module import InterleaveGRPO


class InterleaveCLI(LightningCLI):
    """LightningCLI with the data settings the model also needs linked, so they are written once."""

    def add_arguments_to_parser(self, parser) -> None:
        # the tiny model's tokenizer is built from the same corpus and template the data uses
        parser.link_arguments("data.corpus", "model.corpus")
        parser.link_arguments("data.template", "model.template")


def main(args: list[str] | None = None) -> InterleaveCLI:
    """Run the CLI; `args` replaces sys.argv (tests call `main([...])`)."""
    return InterleaveCLI(
        InterleaveGRPO,
        InterleaveDataModule,
        args=args,
        save_config_kwargs={"overwrite": True},
    )


if __name__ == "__main__":
    main()
