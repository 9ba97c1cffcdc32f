"""Text in, interleaving examples out. Knows nothing of models."""

from interleave_data.corpus import Corpus, CorpusError, Text, load_corpus
from interleave_data.curriculum import Curriculum
from interleave_data.curriculum_types import CurriculumSettings
from interleave_data.pairs import Example, build_examples, interleave, split_texts
from interleave_data.prompts import TEMPLATES, format_prompt

__all__ = [
    "TEMPLATES",
    "Corpus",
    "CorpusError",
    "Curriculum",
    "CurriculumSettings",
    "Example",
    "InterleaveDataModule",
    "Text",
    "build_examples",
    "format_prompt",
    "interleave",
    "load_corpus",
    "split_texts",
]


def __getattr__(name: str):
    # Imported on first use: the DataModule pulls in torch and lightning, which the CLI does not need.
    if name == "InterleaveDataModule":
        from interleave_data.datamodule import InterleaveDataModule

        return InterleaveDataModule
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
