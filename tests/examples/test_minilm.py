"""The real all-MiniLM-L6-v2 checkpoint fine-tuned through the Trainer with fp8-hybrid."""

import lightning as L
import torch
from torch.utils.data import DataLoader
from transformers import AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding

import fp8_plugin  # noqa: F401
from fp8_plugin import FP8Linear
from fp8_plugin.tools.data import bbc_news_path, load_text_folders, minilm_path
from reference import count_fp8_gemms


class Classifier(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = AutoModelForSequenceClassification.from_pretrained(minilm_path(), num_labels=5)
        self.model.train()

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=2e-4)


def test_minilm_fine_tunes_on_bbc_news_with_fp8_hybrid():
    texts, labels, classes = load_text_folders(bbc_news_path())
    assert len(texts) == 2225 and len(classes) == 5
    pick = torch.randperm(len(texts), generator=torch.Generator().manual_seed(0))[:32].tolist()
    tok = AutoTokenizer.from_pretrained(minilm_path())
    enc = tok([texts[i] for i in pick], truncation=True, max_length=64)
    rows = [{"input_ids": enc["input_ids"][j], "attention_mask": enc["attention_mask"][j], "labels": labels[i]}
            for j, i in enumerate(pick)]
    collate = DataCollatorWithPadding(tok, pad_to_multiple_of=16)
    batch = collate(rows)

    module = Classifier()
    with torch.no_grad():
        module.model.eval()
        before = module.model(**batch).loss.item()
        module.model.train()
    trainer = L.Trainer(precision="fp8-hybrid", max_steps=12, accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with count_fp8_gemms() as gemms:
        trainer.fit(module, DataLoader(rows, batch_size=8, shuffle=True, collate_fn=collate))
    assert sum(isinstance(m, FP8Linear) for m in module.modules()) == 36
    # 36 layers x (forward, dgrad, wgrad) x 12 steps: every layer ran its GEMMs in FP8.
    assert gemms.count == 36 * 3 * 12
    with torch.no_grad():
        module.model.eval()
        after = module.model(**batch).loss.item()
    assert after < 0.7 * before, (before, after)
