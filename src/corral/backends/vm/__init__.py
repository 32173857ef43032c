"""Full-VM sandboxes with a display (``backend="vm"``): corral.backends.vm.backend."""
