"""The ``verl.plugins`` entry point: registers headloss's run of each verl loss mode as
``headloss_<mode>`` (``actor_rollout_ref.actor.policy_loss.loss_mode=headloss_vanilla``, ...);
verl's own modes and its fused head stay verl's (``headloss.integrations.verl_plugin`` swaps
those too)."""

from .verl import register_losses

register_losses()
