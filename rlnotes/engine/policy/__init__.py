"""The policy/reference pair (policy) and its passes: per-token log-probs over [prompt | completion]
rows (passes), the LM head a block at a time (head), padding skipped (padding), the KV cache layouts
(kvcache), LoRA merged (merged) and weights packed (packed) for sampling, and the value head (critic)."""
