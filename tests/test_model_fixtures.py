"""The shared tiny-model factory: fixtures and the engine worker build the same models from one implementation."""
import torch

from tests import engine_dist_worker, model_factory


def test_fixtures_build_the_factory_models(tiny_pair, make_tiny_models, make_tiny_tokenizer, make_tiny_predictor):
    tok, pred = tiny_pair
    assert not tok.training and not pred.training
    assert tok.config == model_factory.TINY_TOKENIZER and pred.config == model_factory.TINY_PREDICTOR
    tok2, pred2 = make_tiny_models()
    assert all(torch.equal(a, b) for a, b in zip(pred.state_dict().values(), pred2.state_dict().values()))
    assert make_tiny_tokenizer(gamma=0.0, dropout=0.1).config["gamma"] == 0.0
    assert make_tiny_predictor(dropout=0.1).config["resid_dropout_p"] == 0.1
    assert make_tiny_tokenizer().training  # the engine trains it: built in training mode


def test_engine_worker_uses_the_shared_factory():
    assert engine_dist_worker.tiny_tokenizer is model_factory.tiny_tokenizer
    pred = engine_dist_worker.tiny_predictor(dropout=0.2)
    assert pred.config == {**model_factory.TINY_PREDICTOR, "n_layers": 1, "ffn_dropout_p": 0.2,
                           "resid_dropout_p": 0.2}
    again = model_factory.tiny_predictor(seed=1, dropout=0.2, n_layers=1)
    assert all(torch.equal(a, b) for a, b in zip(pred.state_dict().values(), again.state_dict().values()))
    tok = engine_dist_worker.tiny_tokenizer(seed=0)
    torch.manual_seed(0)
    ref = type(tok)(**model_factory.TINY_TOKENIZER)
    assert all(torch.equal(a, b) for a, b in zip(tok.state_dict().values(), ref.state_dict().values()))
