"""Policy, GRPO loss, alignment metric and callbacks for word-interleaving training, in subpackages by job
(docs/ARCHITECTURE.md): model/, generation/, algorithm/, evaluation/, preflight/, run/, runtime/.
"""

from interleave_model import legacy  # noqa: F401  (importing it installs the old module names checkpoints use)
