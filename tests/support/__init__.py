"""Helpers shared by the tests: run the CLI in a fresh process (`cli`), make Hugging Face folders and
reference models (`hf`), attention inputs and references (`attention`), small training jobs
(`training`). Test modules import helpers from here only, never from each other."""
