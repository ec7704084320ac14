"""Importing this module points verl at headloss (:func:`headloss.integrations.verl.install`): the
fused head and every loss mode. For verl's ``actor_rollout_ref.model.external_lib`` or
``VERL_USE_EXTERNAL_MODULES``, which import it in each worker."""

from .verl import install

install()
