"""Inside the model (torch, transformers): keeping packed documents apart (`packing`, `enable_packing`),
the layers with sequence state run one document at a time (`stateful`), the verdict for every family
(`families`), the proof that packing isolates (`isolation`), and tiny random models to prove it on
(`tiny_models`)."""
