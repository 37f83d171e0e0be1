"""Vision-language models: the image encoder (a vision tower and its connector) whose features
replace the image placeholder tokens' embeddings, and multi-axis RoPE positions."""
