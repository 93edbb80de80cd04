//! What the device forces: the last step of resolution, after defaults, config file and flags.

use super::options::MemoryOptions;
use super::probe::{DeviceInfo, DeviceKind, MemoryModel};
use serde::Serialize;

/// One change the device made to what the user asked, with its reason.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Override {
    pub option: String,
    pub from: serde_json::Value,
    pub to: serde_json::Value,
    pub reason: String,
}

impl std::fmt::Display for Override {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: {} -> {} ({})",
            self.option, self.from, self.to, self.reason
        )
    }
}

/// Why a copy stream moves one block per group.
const STREAMED_GROUPS: &str = "with a copy stream, groups are single blocks as in diffusers' \
     use_stream (the copies keep pace block by block; larger groups only hold more memory); \
     --prefetch-depth N fills N slots ahead";

/// Why the CPU changes options: with no accelerator there is nothing to offload to.
const NO_ACCELERATOR: &str = "no accelerator";

/// The lines that report `overrides` on stderr: one per change, except the changes the lack of
/// an accelerator forces, which share one line (`a, b: true -> false (no accelerator)`): on the
/// CPU every host-offload option is moot, not a decision worth a line each.
pub fn report_lines(overrides: &[Override]) -> Vec<String> {
    let mut lines: Vec<String> = Vec::new();
    let mut moot: Vec<(&serde_json::Value, &serde_json::Value, Vec<&str>)> = Vec::new();
    for o in overrides {
        if o.reason != NO_ACCELERATOR {
            lines.push(o.to_string());
            continue;
        }
        match moot
            .iter_mut()
            .find(|(from, to, _)| **from == o.from && **to == o.to)
        {
            Some((_, _, options)) => options.push(&o.option),
            None => moot.push((&o.from, &o.to, vec![&o.option])),
        }
    }
    let grouped = moot.into_iter().map(|(from, to, options)| {
        format!("{}: {from} -> {to} ({NO_ACCELERATOR})", options.join(", "))
    });
    grouped.chain(lines).collect()
}

/// The changes from `from` to `to`, each option under its config-file key, all for `reason`.
pub fn changes(from: &MemoryOptions, to: &MemoryOptions, reason: &str) -> Vec<Override> {
    let (serde_json::Value::Object(from), serde_json::Value::Object(to)) =
        (serde_json::json!(from), serde_json::json!(to))
    else {
        return Vec::new();
    };
    to.into_iter()
        .filter(|(key, value)| from.get(key) != Some(value))
        .map(|(key, value)| Override {
            from: from.get(&key).cloned().unwrap_or_default(),
            option: key,
            to: value,
            reason: reason.to_string(),
        })
        .collect()
}

/// Records changes to options, each with the reason in force.
struct Changes<'a> {
    list: Vec<Override>,
    reason: &'a str,
}

impl Changes<'_> {
    fn set<T>(&mut self, option: &'static str, value: &mut T, to: T)
    where
        T: Copy + PartialEq + Into<serde_json::Value>,
    {
        if *value != to {
            self.list.push(Override {
                option: option.to_string(),
                from: (*value).into(),
                to: to.into(),
                reason: self.reason.to_string(),
            });
            *value = to;
        }
    }
}

impl Changes<'_> {
    /// Turns off every option that keeps a component's weights in host memory.
    fn host_offload_off(&mut self, o: &mut MemoryOptions) {
        self.set("dit_layerwise_offload", &mut o.dit_layerwise_offload, false);
        self.set("dit_cpu_offload", &mut o.dit_cpu_offload, false);
        self.set(
            "text_encoder_cpu_offload",
            &mut o.text_encoder_cpu_offload,
            false,
        );
        self.set(
            "image_encoder_cpu_offload",
            &mut o.image_encoder_cpu_offload,
            false,
        );
        self.set("vae_cpu_offload", &mut o.vae_cpu_offload, false);
    }
}

/// Resolves `auto` to the device's default; an explicit choice stays as asked.
fn resolve_auto(value: &mut Option<bool>, auto: bool) {
    value.get_or_insert(auto);
}

/// Applies the memory-model rules to the options and returns every change made.
///
/// - unified memory: host offload only adds copies, so every `*_cpu_offload` and layerwise
///   offload turns off; FSDP stays on CUDA and turns off on Metal; lazy load defaults on, and
///   sequential load defaults on only when lazy load ended up off (lazy owns deferral).
/// - discrete GPU: both auto modes resolve off; layerwise offload excludes FSDP, so FSDP and its
///   `dit_cpu_offload` turn off when both are asked; with a copy stream, groups are one block
///   (diffusers' rule for `use_stream`).
/// - no accelerator: every host-offload option resolves off.
pub fn apply_memory_rules(options: &mut MemoryOptions, device: &DeviceInfo) -> Vec<Override> {
    let reason = match device.memory_model {
        MemoryModel::Unified => format!("unified memory: {}", device.name),
        MemoryModel::Discrete => "dit_layerwise_offload cannot combine with FSDP".to_string(),
        MemoryModel::None => NO_ACCELERATOR.to_string(),
    };
    let mut changes = Changes {
        list: Vec::new(),
        reason: &reason,
    };
    let o = options;
    match device.memory_model {
        MemoryModel::Unified => {
            changes.host_offload_off(o);
            if device.kind == DeviceKind::Metal {
                changes.set("use_fsdp_inference", &mut o.use_fsdp_inference, false);
            }
            resolve_auto(&mut o.lazy_module_load, true);
            let lazy = o.lazy();
            resolve_auto(&mut o.h3_sequential_load, !lazy);
        }
        MemoryModel::Discrete => {
            resolve_auto(&mut o.lazy_module_load, false);
            resolve_auto(&mut o.h3_sequential_load, false);
            if o.dit_layerwise_offload && o.use_fsdp_inference {
                changes.set("use_fsdp_inference", &mut o.use_fsdp_inference, false);
                changes.set("dit_cpu_offload", &mut o.dit_cpu_offload, false);
            }
        }
        MemoryModel::None => {
            changes.host_offload_off(o);
            changes.set("use_fsdp_inference", &mut o.use_fsdp_inference, false);
            changes.set("pin_cpu_memory", &mut o.pin_cpu_memory, false);
            changes.set("model_cpu_offload", &mut o.model_cpu_offload, false);
            changes.set(
                "sequential_cpu_offload",
                &mut o.sequential_cpu_offload,
                false,
            );
            // Host memory is the only memory: loading late and freeing early lowers the peak.
            resolve_auto(&mut o.lazy_module_load, true);
            let lazy = o.lazy();
            resolve_auto(&mut o.h3_sequential_load, !lazy);
        }
    }
    if device.memory_model == MemoryModel::Discrete && o.offload_stream && !o.leaf_level {
        let mut streamed = Changes {
            list: Vec::new(),
            reason: STREAMED_GROUPS,
        };
        streamed.set("num_blocks_per_group", &mut o.num_blocks_per_group, 1);
        changes.list.extend(streamed.list);
    }
    changes.list
}
