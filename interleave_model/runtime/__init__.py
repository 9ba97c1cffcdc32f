"""What this machine and these library versions allow: bf16, engines, threads, version shims."""
