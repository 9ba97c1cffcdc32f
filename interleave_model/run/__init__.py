"""What the Trainer is handed: run folders, callbacks, sample dumps, checkpoint writers, the console."""
