"""Weight layouts and conversion between Hugging Face and Megatron."""
