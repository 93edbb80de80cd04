//! Writers for the generated frames: MP4, PNG folders and safetensors.
