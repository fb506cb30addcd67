"""The vision tower of Qwen3.5/3.6 (image input): its mmproj GGUF file, the image
processor and the numpy reference forward. docs/vision.md says what each step computes."""
