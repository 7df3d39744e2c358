"""The sampler (the rollout section of the config): G completions of each prompt (generate), whole
multi-turn episodes (episodes), rlnotes' own decoding step (decoder) and a vLLM engine (vllm_engine)."""
