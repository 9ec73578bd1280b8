"""The network-fault harness: processes in network namespaces on a private bridge, and the faults networks have.

:mod:`~stalwart.testing.network.topology` names and addresses the network and
spells each fault's ``ip``/``tc`` command (pure); :mod:`~stalwart.testing.network.netns`
runs them (:class:`~stalwart.testing.network.netns.Bridge`, root only);
:mod:`~stalwart.testing.network.job` runs a lighthouse and digits workers on
such a bridge and measures what a fault did to the job.
"""
