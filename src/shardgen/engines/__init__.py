"""The engines behind one seam (kinds): vLLM in process, an OpenAI-compatible server, the fake engine for
tests; a model across several nodes.
"""
