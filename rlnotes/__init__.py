"""rlnotes: RL fine-tuning for language models, equation by equation."""
__version__ = "0.1.0"
