"""Policy, GRPO loss, alignment metric and callbacks for word-interleaving training, in subpackages by job
(docs/ARCHITECTURE.md): model/, generation/, algorithm/, evaluation/, preflight/, run/, runtime/.
"""
