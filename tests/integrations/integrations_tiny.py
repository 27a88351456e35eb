"""A tiny Llama and dataset for the integration tests (a helper module, not a conftest)."""

import torch

LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=4, vocab_size=1000, max_position_embeddings=1024)
SEQ = 128


class Tokens(torch.utils.data.Dataset):
    """``n`` random sequences of ``seq`` token ids, labels = inputs (causal LM)."""

    def __init__(self, n: int = 16, seq: int = SEQ, vocab: int = LLAMA["vocab_size"]) -> None:
        self.n, self.seq, self.vocab = n, seq, vocab

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(0, self.vocab, (self.seq,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone()}


def tiny_llama(attention: str = "sdpa"):
    from trainmem.models.hf import build_hf_model
    torch.manual_seed(0)
    return build_hf_model(LLAMA, attention=attention)


def training_args(tmp_path, **kw):
    from transformers import TrainingArguments
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=2, report_to=[], use_cpu=True,
                save_strategy="no", logging_steps=1, disable_tqdm=True, dataloader_num_workers=0)
    return TrainingArguments(**{**base, **kw})
