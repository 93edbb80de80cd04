//! A Linear layer over every row of its input as one matrix product, its bias added as PyTorch
//! adds a Linear's on the GPU. candle's `Linear` runs a 3-D input as one product per batch entry
//! against a broadcast weight (which wastes the GPU where there are many short sequences, as
//! Latte's temporal blocks have) and adds the bias in a second pass over the product (a third of
//! FLUX.1's forward went to those adds). On CUDA bf16 the bias, and a tanh GELU where asked, go
//! into the product's epilogue instead: the f32 accumulator gets the bias before the one rounding
//! to bf16, as `addmm` does. Elsewhere: the product, then the bias (and the GELU), as candle adds
//! them.
//!
//! [`Projection`] is a Linear whose product may instead be an fp8 one (`--fp8-matmul`,
//! [`crate::models::fp8`]).

use std::cell::OnceCell;
use std::sync::{Arc, OnceLock};

use candle_core::{DType, Module, Result, Tensor};
use candle_nn::Linear;

use crate::models::fp8::{self, Fp8Rows};

/// A DiT's Linear layer, its product exact or (`fp8`) in e4m3 with per-channel and per-token
/// scales. The fp8 weight is made from the landed weight at the layer's first product: once per
/// landing (a streamed block is built anew each time it lands), and never for a build that only
/// records which weights a block asks for (those are not real tensors).
#[derive(Debug, Clone)]
pub struct Projection {
    linear: Linear,
    /// The quantized weight once made (shared by clones of the layer); `None`: exact.
    fp8: Option<Arc<OnceLock<Fp8Rows>>>,
}

impl Projection {
    /// `linear`, in fp8 where `fp8`.
    pub fn new(linear: Linear, fp8: bool) -> Self {
        Self {
            linear,
            fp8: fp8.then(Default::default),
        }
    }

    /// The Linear `(in, out)` with bias under `vb`, in fp8 where `fp8`.
    pub fn load(in_out: (usize, usize), vb: candle_nn::VarBuilder, fp8: bool) -> Result<Self> {
        Self::load_with(in_out, true, vb, fp8)
    }

    /// The Linear `(in, out)` under `vb`, with its bias where `bias`, in fp8 where `fp8`.
    pub fn load_with(
        (inner, out): (usize, usize),
        bias: bool,
        vb: candle_nn::VarBuilder,
        fp8: bool,
    ) -> Result<Self> {
        let linear = if bias {
            candle_nn::linear(inner, out, vb)?
        } else {
            candle_nn::linear_no_bias(inner, out, vb)?
        };
        Ok(Self::new(linear, fp8))
    }

    pub fn weight(&self) -> &Tensor {
        self.linear.weight()
    }

    pub fn bias(&self) -> Option<&Tensor> {
        self.linear.bias()
    }

    /// Whether the product is an fp8 one: a norm in front of only such layers can hand them its
    /// rows as codes ([`Input::quantized`]).
    pub fn is_fp8(&self) -> bool {
        self.fp8.is_some()
    }

    /// The fp8 product of `x` `[..., in]`, plus `bias` and then GELU(tanh) where `gelu`; `None`
    /// for an exact layer (the caller computes it its own way).
    pub fn fp8_product(
        &self,
        x: &Input,
        bias: Option<&Tensor>,
        gelu: bool,
    ) -> Result<Option<Tensor>> {
        let Some(cell) = &self.fp8 else {
            return Ok(None);
        };
        let weight = match cell.get() {
            Some(w) => w,
            None => {
                // Two threads may both quantize a layer; they make the same codes.
                let _ = cell.set(Fp8Rows::quantize(self.weight(), true)?);
                cell.get().unwrap_or_else(|| unreachable!("set above"))
            }
        };
        let Some(rows) = &x.rows else {
            let codes = x
                .codes
                .get()
                .unwrap_or_else(|| unreachable!("made with codes"));
            return fp8::linear_codes(codes, x.dtype, weight, bias, gelu).map(Some);
        };
        let dims = rows.dims();
        let Some((&inner, outer)) = dims.split_last() else {
            candle_core::bail!("a Linear layer's input needs at least one dimension")
        };
        let mut shape = outer.to_vec();
        shape.push(weight.rows);
        let flat = rows.reshape(((), inner))?;
        fp8::linear_sharing(&flat, &x.codes, weight, bias, gelu)?
            .reshape(shape)
            .map(Some)
    }
}

/// A Linear's input `[..., in]`, with the e4m3 codes of its rows made by the first fp8 layer
/// that reads it and kept for the others that read it too; or ([`Self::quantized`]) the codes
/// alone, of `[rows, in]` rows that were never stored.
pub struct Input {
    rows: Option<Tensor>,
    codes: OnceCell<Fp8Rows>,
    /// The products' dtype.
    dtype: DType,
}

impl Input {
    pub fn new(x: &Tensor) -> Self {
        Self {
            rows: Some(x.clone()),
            codes: OnceCell::new(),
            dtype: x.dtype(),
        }
    }

    /// Rows that exist only as their codes, for fp8 layers alone, whose products come out in
    /// `dtype`.
    pub fn quantized(codes: Fp8Rows, dtype: DType) -> Self {
        Self {
            rows: None,
            codes: OnceCell::from(codes),
            dtype,
        }
    }

    /// The rows, which an exact layer reads; an error for codes alone.
    pub fn tensor(&self) -> Result<&Tensor> {
        match &self.rows {
            Some(rows) => Ok(rows),
            None => candle_core::bail!("an exact Linear given an input that exists as fp8 codes"),
        }
    }

    /// `[rows, in]` of the rows as a Linear reads them.
    pub fn dims2(&self) -> Result<(usize, usize)> {
        match (&self.rows, self.codes.get()) {
            (Some(rows), _) => {
                let dims = rows.dims();
                let inner = *dims.last().unwrap_or(&0);
                Ok((rows.elem_count() / inner.max(1), inner))
            }
            (None, Some(codes)) => Ok((codes.rows, codes.cols)),
            (None, None) => unreachable!("an input has rows or codes"),
        }
    }
}

impl Module for Projection {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_input(&Input::new(x))
    }
}

impl Projection {
    /// The layer of `x` `[..., in]` with its bias: the fp8 product, or candle's `Linear` (a
    /// model whose exact path is candle's arithmetic keeps it bit for bit).
    pub fn forward_input(&self, x: &Input) -> Result<Tensor> {
        match self.fp8_product(x, self.bias(), false)? {
            Some(y) => Ok(y),
            None => self.linear.forward(x.tensor()?),
        }
    }

    /// `x @ W^T` without the bias, for `x` `[rows, in]`: a fused op after it adds the bias.
    pub fn product(&self, x: &Input) -> Result<Tensor> {
        match self.fp8_product(x, None, false)? {
            Some(y) => Ok(y),
            None => x.tensor()?.matmul(&self.weight().t()?),
        }
    }

    /// The exact product of `x` `[..., in]` (a layer without bias) written into `dst`, a contiguous
    /// `[rows, out]` view of a larger buffer; `false` (nothing written) where it cannot be: an fp8
    /// or biased layer, or anything but bf16 on CUDA.
    pub fn product_into(&self, x: &Input, dst: &Tensor) -> Result<bool> {
        if self.is_fp8() || self.bias().is_some() {
            return Ok(false);
        }
        #[cfg(feature = "cuda")]
        {
            let x = x.tensor()?;
            let inner = x.dim(candle_core::D::Minus1)?;
            crate::models::linear::product_into(dst, &x.reshape(((), inner))?, self.weight())
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (x, dst);
            Ok(false)
        }
    }

    /// The layer of `x` `[..., in]`, then GELU(tanh) where `gelu`: the bias (and GELU) in the
    /// product's epilogue on CUDA, in bf16 as in fp8 ([`project`]'s arithmetic for an exact
    /// layer).
    pub fn apply(&self, x: &Input, gelu: bool) -> Result<Tensor> {
        match self.fp8_product(x, self.bias(), gelu)? {
            Some(y) => Ok(y),
            None => rows_through(&self.linear, x.tensor()?, gelu),
        }
    }
}

/// `linear` of `x` `[..., in]`.
pub fn project(linear: &Linear, x: &Tensor) -> Result<Tensor> {
    rows_through(linear, x, false)
}

/// GELU (tanh approximation) of `linear` of `x` `[..., in]`.
pub fn project_gelu_tanh(linear: &Linear, x: &Tensor) -> Result<Tensor> {
    rows_through(linear, x, true)
}

fn rows_through(linear: &Linear, x: &Tensor, gelu: bool) -> Result<Tensor> {
    let dims = x.dims();
    let Some((&inner, outer)) = dims.split_last() else {
        candle_core::bail!("a Linear layer's input needs at least one dimension")
    };
    let rows = x.reshape(((), inner))?;
    let mut shape = outer.to_vec();
    shape.push(linear.weight().dim(0)?);
    #[cfg(feature = "cuda")]
    if let Some(bias) = linear.bias() {
        if let Some(y) = crate::models::linear::linear_bias_act(&rows, linear.weight(), bias, gelu)?
        {
            return y.reshape(shape);
        }
    }
    let y = linear.forward(&rows)?;
    let y = if gelu { y.gelu()? } else { y };
    y.reshape(shape)
}
