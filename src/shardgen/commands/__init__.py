"""The commands a person or the controller runs over a run directory: the report, the status, the stop, the
run's lock, the status check.
"""
