"""Check a model against the curriculum (token counts, chat template, round trip) before any step."""
