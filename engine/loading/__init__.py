"""From a `--model` value to a loaded model: sources, safetensors and GGUF readers, weights, tokenizer."""
