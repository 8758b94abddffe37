"""Model weights on disk: training checkpoints, meshlm params folders and Hugging Face folders.

Bottom to top: `safetensors_io` (the file format), `hf_map` (meshlm leaves <-> Hugging Face tensor names and
layouts), `folders` (config.json, carried tokenizer files, atomic output), `source` (the weight-reader
interface), one module per format (`hf_folder`, `params_folder`, `train_checkpoint`), `weights` (open any of
them, `--init_from`), `convert` (the convert/export operations). `manager` is the Orbax train-state
`Checkpointer`. Reading and mapping a Hugging Face config.json is `meshlm.models.hf_config.read_hf_config`.
"""
