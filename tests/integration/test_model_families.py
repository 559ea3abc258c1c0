"""The pass on transformers' other vocabulary heads: seq2seq (BART and Marian with their
``final_logits_bias``, T5), a masked LM (BERT, its head's transform before the decoder), a
vision-language model (LLaVA, image tokens in the text) and speech (Whisper), each built
from a tiny config.

One training step each, ``model(**batch).loss.backward()``, compiled by chunkce and, on a
deep copy, by stock ``aot_eager``: the site rewritten (the op's node in the graph the inner
backend got and no ``[N, V]`` node), and the loss, the returned logits and every parameter
gradient equal to stock compile's.
"""

from __future__ import annotations

import copy

import pytest
import torch
from builders import OP
from rewrite_proof import Recorder
from torch._dynamo.utils import counters

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fresh_compile", "eager_kernels")]

V = 257  # odd vocabulary
B, T = 2, 8
IMAGE_TOKEN = V - 1
SEQ2SEQ = dict(vocab_size=V, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
               decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
               dropout=0.0, attention_dropout=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2,
               decoder_start_token_id=2)
TEXT = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            max_position_embeddings=64)


def ids(shape, seed):
    return torch.randint(3, V - 1, shape, generator=torch.Generator().manual_seed(seed))


def text_batch():
    labels = ids((B, T), 1)
    labels[0, -2:] = -100  # a padded target
    return {"input_ids": ids((B, T), 0), "labels": labels}


def with_bias(model):
    with torch.no_grad():  # the buffer is zeros at init: make it count
        model.final_logits_bias.normal_(0, 0.5)
    return model


def bart():
    from transformers import BartConfig, BartForConditionalGeneration
    return with_bias(BartForConditionalGeneration(BartConfig(**SEQ2SEQ))), text_batch(), T


def marian():
    from transformers import MarianConfig, MarianMTModel
    return with_bias(MarianMTModel(MarianConfig(**SEQ2SEQ, decoder_vocab_size=V))), text_batch(), T


def t5():
    from transformers import T5Config, T5ForConditionalGeneration
    config = T5Config(vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4, dropout_rate=0.0,
                      decoder_start_token_id=0)
    return T5ForConditionalGeneration(config), text_batch(), T


def bert():
    from transformers import BertConfig, BertForMaskedLM
    config = BertConfig(**TEXT, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    input_ids = ids((B, T), 0)
    labels = torch.full_like(input_ids, -100)
    labels[:, 1::3] = input_ids[:, 1::3]  # the masked positions
    input_ids[:, 1::3] = 4
    return BertForMaskedLM(config), {"input_ids": input_ids, "labels": labels}, T


def llava():
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                              image_size=32, patch_size=8)
    config = LlavaConfig(vision_config=vision, text_config=LlamaConfig(**TEXT, num_key_value_heads=2),
                         image_token_index=IMAGE_TOKEN, projector_hidden_act="gelu")
    image_tokens = (32 // 8) ** 2  # the patches; the CLS feature is dropped ("default")
    input_ids = torch.cat([ids((B, 1), 0), torch.full((B, image_tokens), IMAGE_TOKEN), ids((B, T), 1)], 1)
    labels = input_ids.masked_fill(input_ids == IMAGE_TOKEN, -100)
    pixels = torch.randn(B, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    return LlavaForConditionalGeneration(config), {"input_ids": input_ids, "labels": labels,
                                                   "pixel_values": pixels}, input_ids.shape[1]


def whisper():
    from transformers import WhisperConfig, WhisperForConditionalGeneration
    config = WhisperConfig(**{**SEQ2SEQ, "max_position_embeddings": None}, num_mel_bins=16,
                           max_source_positions=16, max_target_positions=32)
    features = torch.randn(B, 16, 2 * 16, generator=torch.Generator().manual_seed(2))  # [B, mel, frames]
    return WhisperForConditionalGeneration(config), {"input_features": features, "labels": text_batch()["labels"]}, T


def step(model, batch):
    out = model(**batch)
    out.loss.backward()
    return out.loss.detach(), out.logits


@pytest.mark.parametrize("make", [bart, marian, t5, bert, llava, whisper],
                         ids=["bart", "marian", "t5", "bert_masked_lm", "llava", "whisper"])
def test_the_head_is_rewritten_and_matches_stock_compile(make):
    torch.manual_seed(0)
    model, batch, tokens = make()
    model.train()
    reference = copy.deepcopy(model)
    recorder, biases = Recorder("aot_eager"), []

    def inner(gm, example_inputs):  # notes the shape of each op node's bias, then the recorder
        for node in gm.graph.find_nodes(op="call_function", target=OP):
            bias = node.args[3]
            biases.append(None if bias is None else tuple(bias.meta["example_value"].shape))
        return recorder(gm, example_inputs)

    loss, logits = step(torch.compile(model, backend="chunkce", options={"inner_backend": inner}), batch)
    expected_loss, expected_logits = step(torch.compile(reference, backend="aot_eager"), batch)

    stats = counters["chunkce"]
    assert (stats["sites_rewritten"], stats["sites_refused"]) == (1, 0), dict(stats)
    recorder.assert_rewritten(B * tokens, V)  # the op's node, no [N, V] logits in the graph
    torch.testing.assert_close(loss, expected_loss)
    torch.testing.assert_close(logits, expected_logits)  # lazy: read through the recipe
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"{name}.grad: {m}")
    # BART's and Marian's [1, V] final_logits_bias is the op's [V] bias, as BERT's decoder bias is
    has_bias = hasattr(model, "final_logits_bias") or getattr(model.get_output_embeddings(), "bias", None) is not None
    assert biases == [(V,) if has_bias else None], biases
