"""What runs in a job: a shard (generate, with its feed), an elastic worker, the preflight, the merge; the
job's stop flag and who holds a shard.
"""
