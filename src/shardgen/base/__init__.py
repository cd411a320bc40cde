"""The ground floor: files, the run directory, the machine and the job, object storage; nothing of shardgen
above it is imported here.
"""
