"""The settings groups a config writes under `model`, one dataclass each, by job, with TRL's names where TRL has the
knob; the one place a reader looks a setting up. Each group checks its own values when built (`__post_init__`), a
value out of range raising `SettingsError`; the checks across groups are `groups.check_groups`.

```yaml
model:
  base:              {name_or_path: tiny, dtype: null, gradient_checkpointing: false, init_from: null, ...}
  sampling:          {num_generations: 8, temperature: 1.0, top_p: 1.0, top_k: 0, max_new_tokens: null, ...}
  loss:              {epsilon: 0.2, epsilon_high: null, loss_type: grpo, scale_rewards: group, ...}
  kl:                {beta: 0.0, estimator: k3}
  guidance:          {weight: 0.5}                                                                   # null: off
  optimization:      {learning_rate: 1.0e-05, sft_learning_rate: 0.001, warmup_steps: 0, max_grad_norm: 1.0, ...}
  evaluation:        {num_samples: 0, temperature: 1.0, pass_k: null, pass_threshold: 1.0}
  tiny:              {hidden_size: 128, num_layers: 2, num_heads: 4, intermediate_size: 256, ...}
  lora:              {r: 16, alpha: 32, dropout: 0.05, target_modules: all-linear, top_layers: null}   # null: off
  dynamic_sampling:  {max_rounds: 2}                                                                  # null: off
  vllm:              {gpu_memory_utilization: 0.3, max_model_len: null, enforce_eager: false, ...}     # null: off
```

- `policy.py`: `Base` (`model.base`), the model trained and how it is loaded; `TinyModelConfig` (`model.tiny`), the
  embedded tiny model's shape; `LoraSettings` (`model.lora`), the adapter. Read by `model/policy.py`.
- `sampling.py`: `Sampling` (`model.sampling`), how the training rollout samples (`generation/sampler.py`);
  `DynamicSampling` (`model.dynamic_sampling`), DAPO's refill (`algorithm/dynamic_sampling.py`); `VllmSettings`
  (`model.vllm`), the vLLM engine's options (`generation/vllm_engine.py`).
- `loss.py`: `Loss` (`model.loss`), GRPO's advantages and clipped policy loss (`algorithm/grpo.py`); `Kl`
  (`model.kl`) and `Guidance` (`model.guidance`), the auxiliary terms (`algorithm/kl.py`, and
  `algorithm/update.target_backward` weighted by mu).
- `optimization.py`: `Optimization` (`model.optimization`), the optimizer and `algorithm/schedule.py`'s rate.
- `evaluation.py`: `Evaluation` (`model.evaluation`), how validation, test and predict answer
  (`evaluation/evaluator.py`).
- `groups.py`: the groups the module holds (`GROUPS`, `TERMS`, `OPTIONAL`), what it is given made its groups and
  checked across them (`module_groups`), and the groups as its hyperparameters keep them (`as_hparams`).

The string choices are `Literal`s (`TinyPositions`, `KlEstimator`, `LossType`, `ScaleRewards`, `AdvantageEstimator`,
`LrSchedule`), so a typo fails when the config is parsed. The package imports nothing of the project; the code that
reads a group imports it from its module. Checkpoints written before the groups existed hold them flat
(`model_name_or_path`, `temperature`, `eval_num_samples`, ...), or the auxiliary terms' settings in `loss`;
`model/migrations.py` puts them into today's groups. The classes a checkpoint pickles are named there by every module
path they had (`migrations.old_paths`), which `model/checkpoint.py` registers with torch.
"""


class SettingsError(ValueError):
    """A setting out of its range, or settings that do not fit together: the CLI says it in one `error:` line."""
