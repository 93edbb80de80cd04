//! The original single-file layouts of the transformers diffusers converts with
//! `from_single_file`, as its converters read them: Wan-AI's and LTX-Video's (renamings), FLUX.1's
//! (Black Forest Labs: `double_blocks.N` / `single_blocks.N`,
//! `convert_flux_transformer_checkpoint_to_diffusers`), HunyuanVideo's
//! (`convert_hunyuan_video_transformer_to_diffusers`), Mochi-1's
//! (`convert_mochi_transformer_checkpoint_to_diffusers`) and MiniMax H3's
//! (`convert_minimax_h3_transformer_checkpoint_to_diffusers`). The last four fuse the attention's
//! q, k and v in one matrix (`img_attn.qkv`, `qkv_x`, `qkv_proj`; in a single block with the MLP's
//! input, `linear1`) and store some halves swapped (the output norm's modulation shift first,
//! diffusers' scale first; Mochi-1's and MiniMax H3's SwiGLU input): a diffusers weight is a
//! [`Piece`] of an original tensor.

/// A model whose original layout vidgen reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Model {
    Wan,
    Flux,
    HunyuanVideo,
    LtxVideo,
    Mochi,
    MiniMaxH3,
}

impl Model {
    pub const ALL: [Model; 6] = [
        Model::Wan,
        Model::Flux,
        Model::HunyuanVideo,
        Model::LtxVideo,
        Model::Mochi,
        Model::MiniMaxH3,
    ];

    /// Its name in messages.
    pub fn name(self) -> &'static str {
        match self {
            Model::Wan => "Wan-AI",
            Model::Flux => "FLUX.1",
            Model::HunyuanVideo => "HunyuanVideo",
            Model::LtxVideo => "LTX-Video",
            Model::Mochi => "Mochi-1",
            Model::MiniMaxH3 => "MiniMax H3",
        }
    }

    /// A key only this layout has (diffusers' own detection key).
    pub fn marker(self) -> &'static str {
        match self {
            Model::Wan => "head.modulation",
            Model::Flux => "double_blocks.0.img_attn.norm.key_norm.scale",
            Model::HunyuanVideo => {
                "txt_in.individual_token_refiner.blocks.0.adaLN_modulation.1.bias"
            }
            Model::LtxVideo => "patchify_proj.weight",
            Model::Mochi => "blocks.0.attn.qkv_x.weight",
            Model::MiniMaxH3 => "token_refiner.blocks.0.attn.qkv_proj.weight",
        }
    }

    /// The diffusers modules kohya (sd-scripts) LoRA module `module` changes and the piece of
    /// its up matrix each takes (FLUX.1's layout; those outside the blocks, which diffusers'
    /// conversion leaves out, none); `None` where the layout maps no kohya LoRAs or the name is
    /// not one of its modules.
    pub fn kohya_targets(self, module: &str) -> Option<Vec<(String, Piece)>> {
        match self {
            Model::Flux => FLUX.targets(module, true),
            _ => None,
        }
    }

    /// The diffusers modules original module `module` (a LoRA's under `diffusion_model.`, named
    /// as diffusers' LoRA conversion for the model reads it) changes and the piece each takes
    /// (HunyuanVideo's layout; LTX-Video's, which is diffusers' names); `None` where the layout
    /// maps no such LoRAs or the name is not one of its modules.
    pub fn original_targets(self, module: &str) -> Option<Vec<(String, Piece)>> {
        match self {
            Model::HunyuanVideo => HUNYUAN_VIDEO.targets(module, false),
            // diffusers' LTX-Video conversion renames nothing (its LoRAs use diffusers' names).
            Model::LtxVideo => Some(vec![(module.to_string(), Piece::Whole)]),
            _ => None,
        }
    }

    /// The original key and piece of diffusers weight `name` (`None`: a name the layout does
    /// not map, which the file then holds under its diffusers name or lacks).
    pub fn original(self, name: &str) -> Option<(String, Piece)> {
        match self {
            Model::Wan => crate::lora::diffusers_to_original(name).map(|k| (k, Piece::Whole)),
            Model::Flux => FLUX.original(name),
            Model::HunyuanVideo => HUNYUAN_VIDEO.original(name),
            Model::LtxVideo => ltx_video(name).map(|k| (k, Piece::Whole)),
            Model::Mochi => MOCHI.original(name),
            Model::MiniMaxH3 => MINIMAX_H3.original(name),
        }
    }
}

/// Where a diffusers weight lies in its original tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Piece {
    Whole,
    /// Third `i` of the first dimension (q, k, v of a fused `qkv`).
    Third(usize),
    /// Part `i` of a single block's `linear1`, split (D, D, D, rest) along the first dimension,
    /// D the rows of the block's `linear2` (its output width): q, k, v, then the MLP's input.
    Linear1 {
        part: usize,
        block: usize,
    },
    /// The two halves of the first dimension swapped (shift, scale stored; scale, shift wanted).
    SwappedHalves,
}

/// The key of single block `block`'s `linear2` weight (FLUX.1's and HunyuanVideo's), whose rows
/// give [`Piece::Linear1`]'s D.
pub fn linear2(block: usize) -> String {
    format!("single_blocks.{block}.linear2.weight")
}

/// How a diffusers module is stored in an original layout.
#[derive(Clone, Copy)]
enum Stored {
    /// As the original module, the same parameters.
    As(&'static str),
    /// Third `i` of the fused original module.
    Third(&'static str, usize),
    /// Part `i` of a single block's fused `linear1`.
    Linear1(usize),
    /// The original module with the halves of its first dimension swapped.
    Swapped(&'static str),
    /// The original module's `scale` (an RMS norm's `weight`).
    Scale(&'static str),
}

/// How each module of a block (or of the model outside its blocks) is stored.
type Modules = &'static [(&'static str, Stored)];

/// An original layout: per block list, diffusers' prefix, the original prefix and how each
/// module of a block is stored; then the modules outside the blocks.
struct Layout {
    lists: &'static [(&'static str, &'static str, Modules)],
    top: Modules,
}

use Stored::{As, Linear1, Scale, Swapped, Third};

const FLUX: Layout = Layout {
    lists: &[
        (
            "transformer_blocks",
            "double_blocks",
            &[
                ("norm1.linear", As("img_mod.lin")),
                ("norm1_context.linear", As("txt_mod.lin")),
                ("attn.to_q", Third("img_attn.qkv", 0)),
                ("attn.to_k", Third("img_attn.qkv", 1)),
                ("attn.to_v", Third("img_attn.qkv", 2)),
                ("attn.add_q_proj", Third("txt_attn.qkv", 0)),
                ("attn.add_k_proj", Third("txt_attn.qkv", 1)),
                ("attn.add_v_proj", Third("txt_attn.qkv", 2)),
                ("attn.norm_q", Scale("img_attn.norm.query_norm")),
                ("attn.norm_k", Scale("img_attn.norm.key_norm")),
                ("attn.norm_added_q", Scale("txt_attn.norm.query_norm")),
                ("attn.norm_added_k", Scale("txt_attn.norm.key_norm")),
                ("ff.net.0.proj", As("img_mlp.0")),
                ("ff.net.2", As("img_mlp.2")),
                ("ff_context.net.0.proj", As("txt_mlp.0")),
                ("ff_context.net.2", As("txt_mlp.2")),
                ("attn.to_out.0", As("img_attn.proj")),
                ("attn.to_add_out", As("txt_attn.proj")),
            ],
        ),
        (
            "single_transformer_blocks",
            "single_blocks",
            &[
                ("norm.linear", As("modulation.lin")),
                ("attn.to_q", Linear1(0)),
                ("attn.to_k", Linear1(1)),
                ("attn.to_v", Linear1(2)),
                ("proj_mlp", Linear1(3)),
                ("attn.norm_q", Scale("norm.query_norm")),
                ("attn.norm_k", Scale("norm.key_norm")),
                ("proj_out", As("linear2")),
            ],
        ),
    ],
    top: &[
        (
            "time_text_embed.timestep_embedder.linear_1",
            As("time_in.in_layer"),
        ),
        (
            "time_text_embed.timestep_embedder.linear_2",
            As("time_in.out_layer"),
        ),
        (
            "time_text_embed.text_embedder.linear_1",
            As("vector_in.in_layer"),
        ),
        (
            "time_text_embed.text_embedder.linear_2",
            As("vector_in.out_layer"),
        ),
        (
            "time_text_embed.guidance_embedder.linear_1",
            As("guidance_in.in_layer"),
        ),
        (
            "time_text_embed.guidance_embedder.linear_2",
            As("guidance_in.out_layer"),
        ),
        ("context_embedder", As("txt_in")),
        ("x_embedder", As("img_in")),
        ("proj_out", As("final_layer.linear")),
        ("norm_out.linear", Swapped("final_layer.adaLN_modulation.1")),
    ],
};

const HUNYUAN_VIDEO: Layout = Layout {
    lists: &[
        (
            "transformer_blocks",
            "double_blocks",
            &[
                ("norm1.linear", As("img_mod.linear")),
                ("norm1_context.linear", As("txt_mod.linear")),
                ("attn.to_q", Third("img_attn_qkv", 0)),
                ("attn.to_k", Third("img_attn_qkv", 1)),
                ("attn.to_v", Third("img_attn_qkv", 2)),
                ("attn.add_q_proj", Third("txt_attn_qkv", 0)),
                ("attn.add_k_proj", Third("txt_attn_qkv", 1)),
                ("attn.add_v_proj", Third("txt_attn_qkv", 2)),
                ("attn.norm_q", As("img_attn_q_norm")),
                ("attn.norm_k", As("img_attn_k_norm")),
                ("attn.norm_added_q", As("txt_attn_q_norm")),
                ("attn.norm_added_k", As("txt_attn_k_norm")),
                ("attn.to_out.0", As("img_attn_proj")),
                ("attn.to_add_out", As("txt_attn_proj")),
                ("ff.net.0.proj", As("img_mlp.fc1")),
                ("ff.net.2", As("img_mlp.fc2")),
                ("ff_context.net.0.proj", As("txt_mlp.fc1")),
                ("ff_context.net.2", As("txt_mlp.fc2")),
            ],
        ),
        (
            "single_transformer_blocks",
            "single_blocks",
            &[
                ("norm.linear", As("modulation.linear")),
                ("attn.to_q", Linear1(0)),
                ("attn.to_k", Linear1(1)),
                ("attn.to_v", Linear1(2)),
                ("proj_mlp", Linear1(3)),
                ("attn.norm_q", As("q_norm")),
                ("attn.norm_k", As("k_norm")),
                ("proj_out", As("linear2")),
            ],
        ),
        (
            "context_embedder.token_refiner.refiner_blocks",
            "txt_in.individual_token_refiner.blocks",
            &[
                ("attn.to_q", Third("self_attn_qkv", 0)),
                ("attn.to_k", Third("self_attn_qkv", 1)),
                ("attn.to_v", Third("self_attn_qkv", 2)),
                ("attn.to_out.0", As("self_attn_proj")),
                ("ff.net.0.proj", As("mlp.fc1")),
                ("ff.net.2", As("mlp.fc2")),
                ("norm_out.linear", As("adaLN_modulation.1")),
                ("norm1", As("norm1")),
                ("norm2", As("norm2")),
            ],
        ),
    ],
    top: &[
        ("x_embedder.proj", As("img_in.proj")),
        (
            "time_text_embed.timestep_embedder.linear_1",
            As("time_in.mlp.0"),
        ),
        (
            "time_text_embed.timestep_embedder.linear_2",
            As("time_in.mlp.2"),
        ),
        (
            "time_text_embed.guidance_embedder.linear_1",
            As("guidance_in.mlp.0"),
        ),
        (
            "time_text_embed.guidance_embedder.linear_2",
            As("guidance_in.mlp.2"),
        ),
        (
            "time_text_embed.text_embedder.linear_1",
            As("vector_in.in_layer"),
        ),
        (
            "time_text_embed.text_embedder.linear_2",
            As("vector_in.out_layer"),
        ),
        ("context_embedder.proj_in", As("txt_in.input_embedder")),
        (
            "context_embedder.time_text_embed.timestep_embedder.linear_1",
            As("txt_in.t_embedder.mlp.0"),
        ),
        (
            "context_embedder.time_text_embed.timestep_embedder.linear_2",
            As("txt_in.t_embedder.mlp.2"),
        ),
        (
            "context_embedder.time_text_embed.text_embedder.linear_1",
            As("txt_in.c_embedder.linear_1"),
        ),
        (
            "context_embedder.time_text_embed.text_embedder.linear_2",
            As("txt_in.c_embedder.linear_2"),
        ),
        ("proj_out", As("final_layer.linear")),
        ("norm_out.linear", Swapped("final_layer.adaLN_modulation.1")),
    ],
};

const MOCHI: Layout = Layout {
    lists: &[(
        "transformer_blocks",
        "blocks",
        &[
            ("norm1.linear", As("mod_x")),
            ("norm1_context.linear", As("mod_y")),
            // The last block's context modulation is `linear_1` in diffusers.
            ("norm1_context.linear_1", As("mod_y")),
            ("attn1.to_q", Third("attn.qkv_x", 0)),
            ("attn1.to_k", Third("attn.qkv_x", 1)),
            ("attn1.to_v", Third("attn.qkv_x", 2)),
            ("attn1.add_q_proj", Third("attn.qkv_y", 0)),
            ("attn1.add_k_proj", Third("attn.qkv_y", 1)),
            ("attn1.add_v_proj", Third("attn.qkv_y", 2)),
            ("attn1.norm_q", As("attn.q_norm_x")),
            ("attn1.norm_k", As("attn.k_norm_x")),
            ("attn1.norm_added_q", As("attn.q_norm_y")),
            ("attn1.norm_added_k", As("attn.k_norm_y")),
            ("attn1.to_out.0", As("attn.proj_x")),
            ("attn1.to_add_out", As("attn.proj_y")),
            // The SwiGLU's input is stored projection first, diffusers' gate first.
            ("ff.net.0.proj", Swapped("mlp_x.w1")),
            ("ff.net.2", As("mlp_x.w2")),
            ("ff_context.net.0.proj", Swapped("mlp_y.w1")),
            ("ff_context.net.2", As("mlp_y.w2")),
        ],
    )],
    top: &[
        ("patch_embed.proj", As("x_embedder.proj")),
        (
            "time_embed.timestep_embedder.linear_1",
            As("t_embedder.mlp.0"),
        ),
        (
            "time_embed.timestep_embedder.linear_2",
            As("t_embedder.mlp.2"),
        ),
        ("time_embed.pooler.to_kv", As("t5_y_embedder.to_kv")),
        ("time_embed.pooler.to_q", As("t5_y_embedder.to_q")),
        ("time_embed.pooler.to_out", As("t5_y_embedder.to_out")),
        ("time_embed.caption_proj", As("t5_yproj")),
        ("proj_out", As("final_layer.linear")),
        ("norm_out.linear", Swapped("final_layer.mod")),
    ],
};

/// MiniMax H3's blocks and its token refiner's (`convert_minimax_h3_transformer_checkpoint_to_
/// diffusers`, the published files' stacked `[q; k; v]`; its SwiGLU stores the gate first).
const MINIMAX_H3_BLOCK: Modules = &[
    ("attn.to_q", Third("attn.qkv_proj", 0)),
    ("attn.to_k", Third("attn.qkv_proj", 1)),
    ("attn.to_v", Third("attn.qkv_proj", 2)),
    ("attn.norm_q", As("attn.q_norm")),
    ("attn.norm_k", As("attn.k_norm")),
    ("attn.to_out.0", As("attn.out_proj")),
    ("ff.net.0.proj", Swapped("mlp.fc1")),
    ("ff.net.2", As("mlp.fc2")),
    ("adaln_proj.linear", As("adaln_proj.linear")),
    ("norm1", As("norm1")),
    ("norm2", As("norm2")),
];

const MINIMAX_H3: Layout = Layout {
    lists: &[
        ("transformer_blocks", "blocks", MINIMAX_H3_BLOCK),
        (
            "token_refiner.refiner_blocks",
            "token_refiner.blocks",
            MINIMAX_H3_BLOCK,
        ),
    ],
    top: &[
        ("proj_in", As("video_patch_proj")),
        ("audio_proj_in", As("audio_patch_proj")),
        ("context_embedder", As("condition_proj")),
        ("time_embedder.linear_1", As("time_embedder.proj_in")),
        ("time_embedder.linear_2", As("time_embedder.proj_out")),
        ("token_refiner.final_norm", As("token_refiner.final_norm")),
        ("norm_out.norm", As("final_layer.norm")),
        ("norm_out.linear", As("final_layer.adaln_proj.linear")),
        ("proj_out", As("final_layer.video_out")),
        ("audio_proj_out", As("final_layer.audio_out")),
    ],
};

impl Stored {
    /// The original module it is (part of).
    fn module(self) -> &'static str {
        match self {
            As(m) | Third(m, _) | Swapped(m) | Scale(m) => m,
            Linear1(_) => "linear1",
        }
    }
}

impl Layout {
    /// The diffusers modules original module `module` holds, with the piece of it each is:
    /// named as the layout names it or, `kohya`, as kohya (sd-scripts) LoRAs name it (`_` for
    /// `.`; its modules outside the blocks, which diffusers' conversion leaves out, give none).
    /// `None` for a name of no module of the layout.
    fn targets(&self, module: &str, kohya: bool) -> Option<Vec<(String, Piece)>> {
        let dot = if kohya { '_' } else { '.' };
        let name = |m: &str| m.replace('.', &dot.to_string());
        let piece = |stored: Stored, block: Option<usize>| match stored {
            Third(_, i) => Some(Piece::Third(i)),
            Linear1(part) => Some(Piece::Linear1 {
                part,
                block: block?,
            }),
            Swapped(_) => Some(Piece::SwappedHalves),
            As(_) | Scale(_) => Some(Piece::Whole),
        };
        for (list, original, modules) in self.lists {
            let Some(rest) = module.strip_prefix(&format!("{}{dot}", name(original))) else {
                continue;
            };
            let (n, layer) = rest.split_once(dot)?;
            let block: usize = n.parse().ok()?;
            let targets: Vec<_> = modules
                .iter()
                .filter(|(_, stored)| name(stored.module()) == layer)
                .map(|&(m, stored)| {
                    Some((format!("{list}.{block}.{m}"), piece(stored, Some(block))?))
                })
                .collect::<Option<_>>()?;
            return (!targets.is_empty()).then_some(targets);
        }
        let top: Vec<_> = self
            .top
            .iter()
            .filter(|(_, stored)| name(stored.module()) == module)
            .map(|&(m, stored)| Some((m.to_string(), piece(stored, None)?)))
            .collect::<Option<_>>()?;
        match (top.is_empty(), kohya) {
            (true, _) => None,
            (false, true) => Some(Vec::new()),
            (false, false) => Some(top),
        }
    }

    /// The original key and piece of diffusers weight `name` (`None`: not in the layout).
    fn original(&self, name: &str) -> Option<(String, Piece)> {
        let (module, param) = name.rsplit_once('.')?;
        let (prefix, block, modules, rest) = self
            .lists
            .iter()
            .find_map(|(list, original, modules)| {
                let rest = module.strip_prefix(list)?.strip_prefix('.')?;
                let (n, rest) = rest.split_once('.')?;
                Some((format!("{original}.{n}."), n.parse().ok(), *modules, rest))
            })
            .unwrap_or((String::new(), None, self.top, module));
        let (_, stored) = modules.iter().find(|(m, _)| *m == rest)?;
        let key = |m: &str, p: &str| format!("{prefix}{m}.{p}");
        Some(match *stored {
            As(m) => (key(m, param), Piece::Whole),
            Third(m, i) => (key(m, param), Piece::Third(i)),
            Linear1(part) => (
                key("linear1", param),
                Piece::Linear1 {
                    part,
                    block: block?,
                },
            ),
            Swapped(m) => (key(m, param), Piece::SwappedHalves),
            Scale(m) if param == "weight" => (key(m, "scale"), Piece::Whole),
            Scale(_) => return None,
        })
    }
}

/// LTX-Video's original key of diffusers weight `name`: `patchify_proj`, `adaln_single`,
/// `q_norm` and `k_norm` for `proj_in`, `time_embed`, `norm_q` and `norm_k`.
fn ltx_video(name: &str) -> Option<String> {
    if let Some(rest) = name.strip_prefix("proj_in.") {
        return Some(format!("patchify_proj.{rest}"));
    }
    if let Some(rest) = name.strip_prefix("time_embed.") {
        return Some(format!("adaln_single.{rest}"));
    }
    let renamed = name
        .replace(".norm_q.", ".q_norm.")
        .replace(".norm_k.", ".k_norm.");
    (renamed != name).then_some(renamed)
}

/// The rows of `piece` in a stored first dimension of `rows`, D being `linear1_d` for a
/// single block's `linear1` (`None` where the rows do not split so).
pub fn rows(piece: Piece, rows: usize, linear1_d: Option<usize>) -> Option<std::ops::Range<usize>> {
    match piece {
        Piece::Whole | Piece::SwappedHalves => Some(0..rows),
        Piece::Third(i) => rows
            .is_multiple_of(3)
            .then(|| i * rows / 3..(i + 1) * rows / 3),
        Piece::Linear1 { part, .. } => {
            let d = linear1_d?;
            match part {
                0..=2 if 3 * d < rows => Some(part * d..(part + 1) * d),
                3 if 3 * d < rows => Some(3 * d..rows),
                _ => None,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_as_diffusers_converts_them() {
        let o = |n: &str| Model::Flux.original(n).unwrap();
        assert_eq!(
            o("transformer_blocks.3.attn.add_k_proj.bias"),
            ("double_blocks.3.txt_attn.qkv.bias".into(), Piece::Third(1))
        );
        assert_eq!(
            o("transformer_blocks.0.attn.norm_added_q.weight"),
            (
                "double_blocks.0.txt_attn.norm.query_norm.scale".into(),
                Piece::Whole
            )
        );
        assert_eq!(
            o("single_transformer_blocks.7.proj_mlp.weight"),
            (
                "single_blocks.7.linear1.weight".into(),
                Piece::Linear1 { part: 3, block: 7 }
            )
        );
        assert_eq!(
            o("norm_out.linear.bias"),
            (
                "final_layer.adaLN_modulation.1.bias".into(),
                Piece::SwappedHalves
            )
        );
        assert_eq!(o("proj_out.weight").0, "final_layer.linear.weight");
        assert_eq!(
            Model::Flux.original("transformer_blocks.0.attn.norm_q.bias"),
            None
        );
    }

    #[test]
    fn kohya_modules_name_their_targets_as_diffusers_converts_them() {
        let t = |m: &str| Model::Flux.kohya_targets(m);
        assert_eq!(
            t("double_blocks_2_txt_attn_qkv").unwrap()[1],
            (
                "transformer_blocks.2.attn.add_k_proj".into(),
                Piece::Third(1)
            )
        );
        assert_eq!(
            t("single_blocks_1_linear1").unwrap()[3],
            (
                "single_transformer_blocks.1.proj_mlp".into(),
                Piece::Linear1 { part: 3, block: 1 }
            )
        );
        assert_eq!(
            t("double_blocks_0_img_mod_lin").unwrap(),
            vec![("transformer_blocks.0.norm1.linear".into(), Piece::Whole)]
        );
        // Outside the blocks: known, left out; unknown: none.
        assert_eq!(t("final_layer_adaLN_modulation_1"), Some(vec![]));
        assert_eq!(t("double_blocks_0_img_attn_qkvz"), None);
        let o = |m: &str| Model::HunyuanVideo.original_targets(m);
        assert_eq!(
            o("final_layer.adaLN_modulation.1"),
            Some(vec![("norm_out.linear".into(), Piece::SwappedHalves)])
        );
        assert_eq!(
            o("txt_in.individual_token_refiner.blocks.0.mlp.fc1"),
            Some(vec![(
                "context_embedder.token_refiner.refiner_blocks.0.ff.net.0.proj".into(),
                Piece::Whole
            )])
        );
        assert_eq!(o("double_blocks.0.img_attn_qkv").map(|t| t.len()), Some(3));
    }

    #[test]
    fn fused_rows_split_as_diffusers_splits_them() {
        assert_eq!(rows(Piece::Third(2), 12, None), Some(8..12));
        let q = Piece::Linear1 { part: 0, block: 0 };
        let mlp = Piece::Linear1 { part: 3, block: 0 };
        assert_eq!(rows(q, 7 * 4, Some(4)), Some(0..4));
        assert_eq!(rows(mlp, 7 * 4, Some(4)), Some(12..28));
        assert_eq!(rows(Piece::Third(0), 10, None), None);
    }
}
