//! The original single-file layouts of the transformers diffusers converts with
//! `from_single_file`, as its converters read them: Wan-AI's and LTX-Video's (renamings), FLUX.1's
//! (Black Forest Labs: `double_blocks.N` / `single_blocks.N`,
//! `convert_flux_transformer_checkpoint_to_diffusers`), HunyuanVideo's
//! (`convert_hunyuan_video_transformer_to_diffusers`) and Mochi-1's
//! (`convert_mochi_transformer_checkpoint_to_diffusers`). The last three fuse the attention's q, k
//! and v in one matrix (`img_attn.qkv`, `qkv_x`; in a single block with the MLP's input,
//! `linear1`) and store the output norm's modulation shift first (diffusers' scale first; Mochi-1
//! its SwiGLU's projection before the gate): a diffusers weight is a [`Piece`] of an original
//! tensor.

/// A model whose original layout vidgen reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Model {
    Wan,
    Flux,
    HunyuanVideo,
    LtxVideo,
    Mochi,
}

impl Model {
    pub const ALL: [Model; 5] = [
        Model::Wan,
        Model::Flux,
        Model::HunyuanVideo,
        Model::LtxVideo,
        Model::Mochi,
    ];

    /// Its name in messages.
    pub fn name(self) -> &'static str {
        match self {
            Model::Wan => "Wan-AI",
            Model::Flux => "FLUX.1",
            Model::HunyuanVideo => "HunyuanVideo",
            Model::LtxVideo => "LTX-Video",
            Model::Mochi => "Mochi-1",
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
        }
    }

    /// The original key and piece of diffusers weight `name` (`None`: a name the layout does
    /// not map, which the file then holds under its diffusers name or lacks).
    pub fn original(self, name: &str) -> Option<(String, Piece)> {
        match self {
            Model::Wan => crate::lora::diffusers_to_original(name).map(|k| (k, Piece::Whole)),
            Model::Flux => flux(name),
            Model::HunyuanVideo => hunyuan_video(name),
            Model::LtxVideo => ltx_video(name).map(|k| (k, Piece::Whole)),
            Model::Mochi => mochi(name),
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

/// FLUX.1's original key and piece of diffusers weight `name`.
fn flux(name: &str) -> Option<(String, Piece)> {
    let (module, param) = name.rsplit_once('.')?;
    let whole = |key: String| Some((format!("{key}.{param}"), Piece::Whole));
    if let Some(rest) = module.strip_prefix("transformer_blocks.") {
        let (n, layer) = rest.split_once('.')?;
        let at = |l: &str| format!("double_blocks.{n}.{l}");
        let qkv = |stream: &str, i: usize| {
            Some((
                format!("{}.{param}", at(&format!("{stream}_attn.qkv"))),
                Piece::Third(i),
            ))
        };
        let norm = |l: &str| Some((at(l), Piece::Whole));
        return match layer {
            "norm1.linear" => whole(at("img_mod.lin")),
            "norm1_context.linear" => whole(at("txt_mod.lin")),
            "attn.to_q" => qkv("img", 0),
            "attn.to_k" => qkv("img", 1),
            "attn.to_v" => qkv("img", 2),
            "attn.add_q_proj" => qkv("txt", 0),
            "attn.add_k_proj" => qkv("txt", 1),
            "attn.add_v_proj" => qkv("txt", 2),
            "attn.norm_q" if param == "weight" => norm("img_attn.norm.query_norm.scale"),
            "attn.norm_k" if param == "weight" => norm("img_attn.norm.key_norm.scale"),
            "attn.norm_added_q" if param == "weight" => norm("txt_attn.norm.query_norm.scale"),
            "attn.norm_added_k" if param == "weight" => norm("txt_attn.norm.key_norm.scale"),
            "ff.net.0.proj" => whole(at("img_mlp.0")),
            "ff.net.2" => whole(at("img_mlp.2")),
            "ff_context.net.0.proj" => whole(at("txt_mlp.0")),
            "ff_context.net.2" => whole(at("txt_mlp.2")),
            "attn.to_out.0" => whole(at("img_attn.proj")),
            "attn.to_add_out" => whole(at("txt_attn.proj")),
            _ => None,
        };
    }
    if let Some(rest) = module.strip_prefix("single_transformer_blocks.") {
        let (n, layer) = rest.split_once('.')?;
        let block: usize = n.parse().ok()?;
        let at = |l: &str| format!("single_blocks.{n}.{l}");
        let linear1 = |part: usize| {
            Some((
                at(&format!("linear1.{param}")),
                Piece::Linear1 { part, block },
            ))
        };
        return match layer {
            "norm.linear" => whole(at("modulation.lin")),
            "attn.to_q" => linear1(0),
            "attn.to_k" => linear1(1),
            "attn.to_v" => linear1(2),
            "proj_mlp" => linear1(3),
            "attn.norm_q" if param == "weight" => Some((at("norm.query_norm.scale"), Piece::Whole)),
            "attn.norm_k" if param == "weight" => Some((at("norm.key_norm.scale"), Piece::Whole)),
            "proj_out" => whole(at("linear2")),
            _ => None,
        };
    }
    let top = match module {
        "time_text_embed.timestep_embedder.linear_1" => "time_in.in_layer",
        "time_text_embed.timestep_embedder.linear_2" => "time_in.out_layer",
        "time_text_embed.text_embedder.linear_1" => "vector_in.in_layer",
        "time_text_embed.text_embedder.linear_2" => "vector_in.out_layer",
        "time_text_embed.guidance_embedder.linear_1" => "guidance_in.in_layer",
        "time_text_embed.guidance_embedder.linear_2" => "guidance_in.out_layer",
        "context_embedder" => "txt_in",
        "x_embedder" => "img_in",
        "proj_out" => "final_layer.linear",
        "norm_out.linear" => {
            return Some((
                format!("final_layer.adaLN_modulation.1.{param}"),
                Piece::SwappedHalves,
            ))
        }
        _ => return None,
    };
    whole(top.to_string())
}

/// HunyuanVideo's original key and piece of diffusers weight `name`.
fn hunyuan_video(name: &str) -> Option<(String, Piece)> {
    let (module, param) = name.rsplit_once('.')?;
    let whole = |key: String| Some((format!("{key}.{param}"), Piece::Whole));
    if let Some(rest) = module.strip_prefix("transformer_blocks.") {
        let (n, layer) = rest.split_once('.')?;
        let at = |l: &str| format!("double_blocks.{n}.{l}");
        let qkv = |stream: &str, i: usize| {
            Some((
                format!("{}.{param}", at(&format!("{stream}_attn_qkv"))),
                Piece::Third(i),
            ))
        };
        return match layer {
            "norm1.linear" => whole(at("img_mod.linear")),
            "norm1_context.linear" => whole(at("txt_mod.linear")),
            "attn.to_q" => qkv("img", 0),
            "attn.to_k" => qkv("img", 1),
            "attn.to_v" => qkv("img", 2),
            "attn.add_q_proj" => qkv("txt", 0),
            "attn.add_k_proj" => qkv("txt", 1),
            "attn.add_v_proj" => qkv("txt", 2),
            "attn.norm_q" => whole(at("img_attn_q_norm")),
            "attn.norm_k" => whole(at("img_attn_k_norm")),
            "attn.norm_added_q" => whole(at("txt_attn_q_norm")),
            "attn.norm_added_k" => whole(at("txt_attn_k_norm")),
            "attn.to_out.0" => whole(at("img_attn_proj")),
            "attn.to_add_out" => whole(at("txt_attn_proj")),
            "ff.net.0.proj" => whole(at("img_mlp.fc1")),
            "ff.net.2" => whole(at("img_mlp.fc2")),
            "ff_context.net.0.proj" => whole(at("txt_mlp.fc1")),
            "ff_context.net.2" => whole(at("txt_mlp.fc2")),
            _ => None,
        };
    }
    if let Some(rest) = module.strip_prefix("single_transformer_blocks.") {
        let (n, layer) = rest.split_once('.')?;
        let block: usize = n.parse().ok()?;
        let at = |l: &str| format!("single_blocks.{n}.{l}");
        let linear1 = |part: usize| {
            Some((
                at(&format!("linear1.{param}")),
                Piece::Linear1 { part, block },
            ))
        };
        return match layer {
            "norm.linear" => whole(at("modulation.linear")),
            "attn.to_q" => linear1(0),
            "attn.to_k" => linear1(1),
            "attn.to_v" => linear1(2),
            "proj_mlp" => linear1(3),
            "attn.norm_q" => whole(at("q_norm")),
            "attn.norm_k" => whole(at("k_norm")),
            "proj_out" => whole(at("linear2")),
            _ => None,
        };
    }
    if let Some(rest) = module.strip_prefix("context_embedder.token_refiner.refiner_blocks.") {
        let (n, layer) = rest.split_once('.')?;
        let at = |l: &str| format!("txt_in.individual_token_refiner.blocks.{n}.{l}");
        let qkv = |i: usize| Some((format!("{}.{param}", at("self_attn_qkv")), Piece::Third(i)));
        return match layer {
            "attn.to_q" => qkv(0),
            "attn.to_k" => qkv(1),
            "attn.to_v" => qkv(2),
            "attn.to_out.0" => whole(at("self_attn_proj")),
            "ff.net.0.proj" => whole(at("mlp.fc1")),
            "ff.net.2" => whole(at("mlp.fc2")),
            "norm_out.linear" => whole(at("adaLN_modulation.1")),
            "norm1" | "norm2" => whole(at(layer)),
            _ => None,
        };
    }
    let top = match module {
        "x_embedder.proj" => "img_in.proj",
        "time_text_embed.timestep_embedder.linear_1" => "time_in.mlp.0",
        "time_text_embed.timestep_embedder.linear_2" => "time_in.mlp.2",
        "time_text_embed.guidance_embedder.linear_1" => "guidance_in.mlp.0",
        "time_text_embed.guidance_embedder.linear_2" => "guidance_in.mlp.2",
        "time_text_embed.text_embedder.linear_1" => "vector_in.in_layer",
        "time_text_embed.text_embedder.linear_2" => "vector_in.out_layer",
        "context_embedder.proj_in" => "txt_in.input_embedder",
        "context_embedder.time_text_embed.timestep_embedder.linear_1" => "txt_in.t_embedder.mlp.0",
        "context_embedder.time_text_embed.timestep_embedder.linear_2" => "txt_in.t_embedder.mlp.2",
        "context_embedder.time_text_embed.text_embedder.linear_1" => "txt_in.c_embedder.linear_1",
        "context_embedder.time_text_embed.text_embedder.linear_2" => "txt_in.c_embedder.linear_2",
        "proj_out" => "final_layer.linear",
        "norm_out.linear" => {
            return Some((
                format!("final_layer.adaLN_modulation.1.{param}"),
                Piece::SwappedHalves,
            ))
        }
        _ => return None,
    };
    whole(top.to_string())
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

/// Mochi-1's original key and piece of diffusers weight `name`.
fn mochi(name: &str) -> Option<(String, Piece)> {
    let (module, param) = name.rsplit_once('.')?;
    let whole = |key: String| Some((format!("{key}.{param}"), Piece::Whole));
    let swapped = |key: String| Some((format!("{key}.{param}"), Piece::SwappedHalves));
    if let Some(rest) = module.strip_prefix("transformer_blocks.") {
        let (n, layer) = rest.split_once('.')?;
        let at = |l: &str| format!("blocks.{n}.{l}");
        let qkv = |stream: &str, i: usize| {
            Some((
                format!("{}.{param}", at(&format!("attn.qkv_{stream}"))),
                Piece::Third(i),
            ))
        };
        return match layer {
            "norm1.linear" => whole(at("mod_x")),
            // The last block's context modulation is `linear_1` in diffusers.
            "norm1_context.linear" | "norm1_context.linear_1" => whole(at("mod_y")),
            "attn1.to_q" => qkv("x", 0),
            "attn1.to_k" => qkv("x", 1),
            "attn1.to_v" => qkv("x", 2),
            "attn1.add_q_proj" => qkv("y", 0),
            "attn1.add_k_proj" => qkv("y", 1),
            "attn1.add_v_proj" => qkv("y", 2),
            "attn1.norm_q" => whole(at("attn.q_norm_x")),
            "attn1.norm_k" => whole(at("attn.k_norm_x")),
            "attn1.norm_added_q" => whole(at("attn.q_norm_y")),
            "attn1.norm_added_k" => whole(at("attn.k_norm_y")),
            "attn1.to_out.0" => whole(at("attn.proj_x")),
            "attn1.to_add_out" => whole(at("attn.proj_y")),
            "ff.net.0.proj" => swapped(at("mlp_x.w1")),
            "ff.net.2" => whole(at("mlp_x.w2")),
            "ff_context.net.0.proj" => swapped(at("mlp_y.w1")),
            "ff_context.net.2" => whole(at("mlp_y.w2")),
            _ => None,
        };
    }
    let top = match module {
        "patch_embed.proj" => "x_embedder.proj",
        "time_embed.timestep_embedder.linear_1" => "t_embedder.mlp.0",
        "time_embed.timestep_embedder.linear_2" => "t_embedder.mlp.2",
        "time_embed.pooler.to_kv" => "t5_y_embedder.to_kv",
        "time_embed.pooler.to_q" => "t5_y_embedder.to_q",
        "time_embed.pooler.to_out" => "t5_y_embedder.to_out",
        "time_embed.caption_proj" => "t5_yproj",
        "proj_out" => "final_layer.linear",
        "norm_out.linear" => return swapped("final_layer.mod".to_string()),
        _ => return None,
    };
    whole(top.to_string())
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
    fn fused_rows_split_as_diffusers_splits_them() {
        assert_eq!(rows(Piece::Third(2), 12, None), Some(8..12));
        let q = Piece::Linear1 { part: 0, block: 0 };
        let mlp = Piece::Linear1 { part: 3, block: 0 };
        assert_eq!(rows(q, 7 * 4, Some(4)), Some(0..4));
        assert_eq!(rows(mlp, 7 * 4, Some(4)), Some(12..28));
        assert_eq!(rows(Piece::Third(0), 10, None), None);
    }
}
