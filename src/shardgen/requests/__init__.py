"""Requests: the task kinds, their prompts and parameters, and the results that come back."""
