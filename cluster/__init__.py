"""The built-in local Kubernetes cluster: control plane from Go modules plus kwok GPU nodes."""
