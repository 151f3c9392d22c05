"""Drop-in place for custom strategies and filters: every module here (sub-packages too) is imported at start-up."""
