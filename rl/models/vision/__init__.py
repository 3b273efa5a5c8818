"""Vision-language models: the vision tower, its input splice and 3-D positions."""
