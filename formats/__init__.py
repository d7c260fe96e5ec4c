"""Every checkpoint format the product reads and writes, and the conversions between them.

Below `train/` and `parity/` (above `torch_model`, `pallas_kernels` and `jax_bridge`), so that
nothing imports upward:
- our checkpoint (Orbax) and its integrity manifest: `checkpoint`, `checkpoint_integrity`;
- LoRA checkpoints (adapters + a reference to the base) and the model inference commands load
  from any checkpoint: `lora_checkpoint`, `lora_inference`;
- Hugging Face directories: transformers GptOss safetensors (bf16/fp32) and gpt-oss as released
  with MXFP4 experts: `hf_weights` (reading), `mxfp4` (the codec), `hf_mapping` (names and shapes),
  `hf_model` (a directory as a torch model), `init_from_hf` (streamed onto a mesh), `hf_export` /
  `hf_import` (the `export` and `import` commands), `lora_export` (peft adapter files), `export_cli`;
- tokenizers: ours (`tokenizer`) and recognising a Hugging Face one (`hf_tokenizer`);
- what every writer and reader shares: atomic writes (`atomic`), JSON read with named errors
  (`jsonfile`), the tensors a config implies (`model_checks`) and `errors.UserError`.
"""
