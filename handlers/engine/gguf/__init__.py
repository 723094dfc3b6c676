"""The GGUF cache: what reading a .gguf file with transformers gives, kept by the file's content
hash so that later starts need not read it again. Shared by the engines that serve GGUF files:
torch and vLLM load the dequantized checkpoint (`cached_gguf_dir`), llama.cpp reads the weights
itself and takes the tokenizer (`cached_tokenizer`)."""
