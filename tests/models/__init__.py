"""Test models written the way JAX users write them, and their one-device references."""
