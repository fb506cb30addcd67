"""Writing mmproj GGUF files: from a Hugging Face checkpoint's vision tower, or random."""
