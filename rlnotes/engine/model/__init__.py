"""The model section of the config: where a base model comes from (sources: checked before anything
loads, standard library only) and loading it with its tokenizer (loading)."""
