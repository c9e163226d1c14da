"""What each epoch trains with (paper Section 3.4): phase 1 (the first `frozen_cnn_epochs`)
the objective C_0 (no MIL) with the CNN fixed, phase 2 C_F (MIL) with the CNN finetuned; the lr
x lr_decay per epoch, x anneal_factor for the last `anneal_last_epochs`; eq. 7's negatives all
summed, or each pair's hardest from `hardest_negative_from_epoch`. The captioner's training
takes its lr from here too."""

from __future__ import annotations

from trainer.config import Config


def in_phase_two(epoch: int, cfg: Config) -> bool:
    """Phase 2 (MIL + CNN finetuning) starts after `frozen_cnn_epochs` epochs (paper 3.4)."""
    return epoch >= cfg.optim.frozen_cnn_epochs


def finetunes_cnn(epoch: int, cfg: Config) -> bool:
    """The CNN trains in phase 2 unless `optim.finetune_cnn` keeps it fixed (an ablation)."""
    return cfg.optim.finetune_cnn and in_phase_two(epoch, cfg)


def learning_rate(epoch: int, cfg: Config) -> float:
    """The cross-validated lr, x lr_decay per epoch (Kiros 4.1), x anneal_factor for the last
    epochs (paper 3.4)."""
    annealed = epoch >= cfg.optim.epochs - cfg.optim.anneal_last_epochs
    return cfg.optim.lr * cfg.optim.lr_decay ** epoch * (cfg.optim.anneal_factor if annealed
                                                          else 1.0)


def epoch_plan(epoch: int, cfg: Config) -> dict[str, int | bool | float]:
    """What an epoch trains with (paper 3.4): its phase, MIL or not, CNN learning or fixed, lr,
    and eq. 7's negatives (all summed, or each pair's hardest)."""
    phase_two = in_phase_two(epoch, cfg)
    hardest = (cfg.objective.hardest_negative
               and epoch >= cfg.objective.hardest_negative_from_epoch)
    return {"phase": 2 if phase_two else 1, "mil": cfg.objective.mil and phase_two,
            "finetunes_cnn": finetunes_cnn(epoch, cfg), "lr": learning_rate(epoch, cfg),
            "hardest_negative": hardest}


def describe_plan(plan: dict[str, int | bool | float], cfg: Config) -> str:
    """An epoch plan in words, for the log line at each change."""
    objective = "C_F with MIL (eq. 5)" if plan["mil"] else "C_0 (eq. 4)"
    cnn = (f"CNN finetuned (lr x {cfg.optim.cnn_lr_scale:g})" if plan["finetunes_cnn"]
           else "CNN fixed")
    negatives = ", hardest negatives (VSE++)" if plan["hardest_negative"] else ""
    return f"phase {plan['phase']}: objective {objective}, {cnn}, lr {plan['lr']:g}{negatives}"
