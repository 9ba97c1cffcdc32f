"""Print the folder of the lm-eval tasks, for `lm_eval --include_path`."""

from interleave_model.evaluation.lm_eval_tasks import FOLDER

print(FOLDER)
