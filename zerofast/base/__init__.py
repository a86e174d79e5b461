"""The vocabulary every layer speaks, importing no other part of zerofast: its errors, its
settings (read from the environment in one place), dtype names and policy, and the keys of
DeepSpeed's checkpoint files."""
