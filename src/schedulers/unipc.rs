//! UniPC multistep sampler (predictor-corrector, B(h) variants) on the flow-matching sigma schedule,
//! as diffusers' `UniPCMultistepScheduler` with `use_flow_sigmas`, `flow_prediction`, `predict_x0`.

use super::{np_linspace, scale, Scheduler, SchedulerConfig};
use anyhow::bail;
use candle_core::{Result, Tensor};

/// The B(h) function of UniPC.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum SolverType {
    /// B(h) = h.
    Bh1,
    /// B(h) = e^h - 1.
    Bh2,
}

/// UniPC multistep state: the schedule plus the history of x0 predictions.
#[derive(Debug)]
pub struct UniPcMultistep {
    timesteps: Vec<f64>,
    sigmas: Vec<f32>,
    /// alpha_i = 1 - sigma_i (f32).
    alphas: Vec<f32>,
    /// lambda_i = ln(alpha_i) - ln(sigma_i) (f32, +inf for sigma = 0).
    lambdas: Vec<f32>,
    solver_order: usize,
    solver_type: SolverType,
    lower_order_final: bool,
    disable_corrector: Vec<usize>,
    step_index: usize,
    /// Previous x0 predictions, newest last, at most `solver_order`.
    model_outputs: Vec<Tensor>,
    lower_order_nums: usize,
    /// The (corrected) sample the last predictor started from.
    last_sample: Option<Tensor>,
    /// The predictor order used at the last step (the corrector reuses it).
    this_order: usize,
}

impl UniPcMultistep {
    /// Validates the config and computes the schedule of `set_timesteps(num_steps)` with `flow_shift`.
    pub fn new(cfg: &SchedulerConfig, num_steps: usize, flow_shift: f64) -> anyhow::Result<Self> {
        cfg.check_flow_model()?;
        let solver_type = check_config(cfg)?;
        if num_steps == 0 {
            bail!("the number of inference steps must be at least 1");
        }

        let n_train = cfg.num_train_timesteps as f64;
        let mut s = np_linspace(1.0, 1.0 / n_train, num_steps + 1);
        s.truncate(num_steps);
        for v in s.iter_mut() {
            *v = flow_shift * *v / (1.0 + (flow_shift - 1.0) * *v);
        }
        if (s[0] - 1.0).abs() < 1e-6 {
            // diffusers: avoids log(0) for alpha at the first step.
            s[0] -= 1e-6;
        }
        // int64 cast truncates toward zero.
        let timesteps: Vec<f64> = s.iter().map(|v| (v * n_train).trunc()).collect();
        // `check_config` admits only "zero" and "sigma_min".
        let last = if cfg.final_sigmas_type == "sigma_min" {
            s[num_steps - 1]
        } else {
            0.0
        };
        let sigmas: Vec<f32> = s
            .iter()
            .chain(std::iter::once(&last))
            .map(|&v| v as f32)
            .collect();
        let alphas: Vec<f32> = sigmas.iter().map(|&s| 1.0 - s).collect();
        let lambdas = alphas
            .iter()
            .zip(&sigmas)
            .map(|(a, s)| a.ln() - s.ln())
            .collect();
        Ok(Self {
            timesteps,
            sigmas,
            alphas,
            lambdas,
            solver_order: cfg.solver_order,
            solver_type,
            lower_order_final: cfg.lower_order_final,
            disable_corrector: cfg.disable_corrector.clone(),
            step_index: 0,
            model_outputs: Vec::with_capacity(cfg.solver_order),
            lower_order_nums: 0,
            last_sample: None,
            this_order: 0,
        })
    }

    /// The coefficients of the B(h) update between lambda indices `s0` (start) and `t` (target):
    /// (h, e^{-h} - 1, B(h), the right-hand side b of UniPC's linear system for `order` terms).
    fn coefficients(&self, s0: usize, t: usize, order: usize) -> (f32, f32, f32, Vec<f32>) {
        let h = self.lambdas[t] - self.lambdas[s0];
        let hh = -h;
        let h_phi_1 = hh.exp_m1();
        let mut h_phi_k = h_phi_1 / hh - 1.0;
        let b_h = match self.solver_type {
            SolverType::Bh1 => hh,
            SolverType::Bh2 => h_phi_1,
        };
        let mut factorial: u64 = 1;
        let mut b = Vec::with_capacity(order);
        for i in 1..=order as u64 {
            b.push(h_phi_k * factorial as f32 / b_h);
            factorial *= i + 1;
            h_phi_k = h_phi_k / hh - (1.0 / factorial as f64) as f32;
        }
        (h, h_phi_1, b_h, b)
    }

    /// The x0 prediction of a velocity output: `sample - sigma * v`, the product in the model dtype
    /// (as torch does with a 0-dim f32 sigma), the difference in the sample dtype.
    fn convert_model_output(&self, model_output: &Tensor, sample: &Tensor) -> Result<Tensor> {
        let sv = scale(model_output, self.sigmas[self.step_index])?.to_dtype(sample.dtype())?;
        sample.sub(&sv)
    }

    /// `(m_k - m0) / r_k` for the `order - 1` older predictions, with r_k measured in lambda from
    /// index `s0` over `h`; `history_of(k)` gives the lambda index of the k-th older prediction.
    fn differences(
        &self,
        order: usize,
        s0: usize,
        h: f32,
        history_of: impl Fn(usize) -> usize,
    ) -> Result<(Vec<f32>, Vec<Tensor>)> {
        let len = self.model_outputs.len();
        let m0 = &self.model_outputs[len - 1];
        let mut rks = Vec::with_capacity(order);
        let mut d1s = Vec::with_capacity(order);
        for k in 1..order {
            let mk = &self.model_outputs[len - 1 - k];
            let rk = (self.lambdas[history_of(k)] - self.lambdas[s0]) / h;
            rks.push(rk);
            d1s.push(div_scalar(&mk.sub(m0)?, rk)?);
        }
        rks.push(1.0);
        Ok((rks, d1s))
    }

    /// UniC: corrects the last predictor's output by redoing its step from `last_sample` with the
    /// new x0 prediction (the predicted sample itself only enters through that prediction).
    fn corrector(&self, this_model_output: &Tensor, last_sample: &Tensor) -> Result<Tensor> {
        let order = self.this_order;
        let i = self.step_index;
        let m0 = &self.model_outputs[self.model_outputs.len() - 1];
        let (h, h_phi_1, b_h, b) = self.coefficients(i - 1, i, order);
        let (rks, d1s) = self.differences(order, i - 1, h, |k| i - (k + 1))?;
        let rhos_c = if order == 1 {
            vec![0.5f32]
        } else {
            solve(&vandermonde(&rks, order), &b)?
        };
        let x_t_ = scale(last_sample, self.sigmas[i] / self.sigmas[i - 1])?
            .sub(&scale(m0, self.alphas[i] * h_phi_1)?)?;
        let d1_t = this_model_output.sub(m0)?;
        let mut res = scale(&d1_t, rhos_c[order - 1])?;
        if let Some(corr) = weighted_sum(&rhos_c[..order - 1], &d1s)? {
            res = corr.add(&res)?;
        }
        let x_t = x_t_.sub(&scale(&res, self.alphas[i] * b_h)?)?;
        x_t.to_dtype(last_sample.dtype())
    }

    /// UniP: predicts the sample at the next sigma from the (corrected) sample and the history.
    fn predictor(&self, sample: &Tensor, order: usize) -> Result<Tensor> {
        let i = self.step_index;
        let m0 = &self.model_outputs[self.model_outputs.len() - 1];
        let (h, h_phi_1, b_h, b) = self.coefficients(i, i + 1, order);
        let (rks, d1s) = self.differences(order, i, h, |k| i - k)?;
        let x_t_ = scale(sample, self.sigmas[i + 1] / self.sigmas[i])?
            .sub(&scale(m0, self.alphas[i + 1] * h_phi_1)?)?;
        let x_t = if d1s.is_empty() {
            x_t_
        } else {
            let rhos_p = if order == 2 {
                vec![0.5f32]
            } else {
                let r = vandermonde(&rks, order);
                let r: Vec<Vec<f32>> = r[..order - 1]
                    .iter()
                    .map(|row| row[..order - 1].to_vec())
                    .collect();
                solve(&r, &b[..order - 1])?
            };
            match weighted_sum(&rhos_p, &d1s)? {
                Some(pred_res) => x_t_.sub(&scale(&pred_res, self.alphas[i + 1] * b_h)?)?,
                None => x_t_,
            }
        };
        x_t.to_dtype(sample.dtype())
    }
}

/// The UniPC settings of a config that this sampler can run, naming the bad key; the B(h)
/// variant it selects.
pub(super) fn check_config(cfg: &SchedulerConfig) -> anyhow::Result<SolverType> {
    if !cfg.use_flow_sigmas {
        bail!("`use_flow_sigmas` must be true: UniPC runs flow_prediction models on flow sigmas");
    }
    if !cfg.predict_x0 {
        bail!("`predict_x0` = false is not supported with flow_prediction");
    }
    let solver_type = match cfg.solver_type.as_str() {
        "bh1" => SolverType::Bh1,
        // diffusers silently maps these DPM-Solver names to bh2.
        "bh2" | "midpoint" | "heun" | "logrho" => SolverType::Bh2,
        other => bail!("`solver_type` {other:?} is not supported (bh1 or bh2)"),
    };
    if cfg.solver_order == 0 {
        bail!("`solver_order` is 0: it must be at least 1");
    }
    if cfg.thresholding {
        bail!("`thresholding` = true is not supported");
    }
    if cfg.solver_p.as_ref().is_some_and(|v| !v.is_null()) {
        bail!("`solver_p` is not supported");
    }
    if !matches!(
        cfg.timestep_spacing.as_str(),
        "linspace" | "leading" | "trailing"
    ) {
        bail!(
            "`timestep_spacing` {:?} is not supported (linspace, leading or trailing)",
            cfg.timestep_spacing
        );
    }
    if !matches!(cfg.final_sigmas_type.as_str(), "zero" | "sigma_min") {
        bail!(
            "`final_sigmas_type` {:?} is not supported (zero or sigma_min)",
            cfg.final_sigmas_type
        );
    }
    Ok(solver_type)
}

impl Scheduler for UniPcMultistep {
    fn timesteps(&self) -> &[f64] {
        &self.timesteps
    }

    fn sigmas(&self) -> &[f32] {
        &self.sigmas
    }

    fn step(&mut self, model_output: &Tensor, sample: &Tensor) -> Result<Tensor> {
        let i = self.step_index;
        super::check_step("UniPC", i, self.timesteps.len())?;
        let use_corrector = i > 0 && !self.disable_corrector.contains(&(i - 1));
        let m = self.convert_model_output(model_output, sample)?;
        let sample = match (&self.last_sample, use_corrector) {
            (Some(last), true) => self.corrector(&m, last)?,
            _ => sample.clone(),
        };
        if self.model_outputs.len() == self.solver_order {
            self.model_outputs.remove(0);
        }
        self.model_outputs.push(m);

        let this_order = if self.lower_order_final {
            self.solver_order.min(self.timesteps.len() - i)
        } else {
            self.solver_order
        };
        self.this_order = this_order.min(self.lower_order_nums + 1);
        let prev_sample = self.predictor(&sample, self.this_order)?;
        self.last_sample = Some(sample);
        if self.lower_order_nums < self.solver_order {
            self.lower_order_nums += 1;
        }
        self.step_index += 1;
        Ok(prev_sample)
    }
}

/// Divides by an f32 scalar (a true division, like torch's tensor / 0-dim tensor).
fn div_scalar(t: &Tensor, s: f32) -> Result<Tensor> {
    let s = Tensor::new(s, t.device())?.to_dtype(t.dtype())?;
    t.broadcast_div(&s)
}

/// `einsum("k,bkc...->bc...", rhos, D1s)`: sum_k rhos[k] * D1s[k]; `None` when there are no terms.
fn weighted_sum(rhos: &[f32], d1s: &[Tensor]) -> Result<Option<Tensor>> {
    let mut acc: Option<Tensor> = None;
    for (r, d) in rhos.iter().zip(d1s) {
        let term = scale(d, *r)?;
        acc = Some(match acc {
            None => term,
            Some(a) => a.add(&term)?,
        });
    }
    Ok(acc)
}

/// Rows `rks^(i-1)` for i = 1..=order (UniPC's R matrix).
fn vandermonde(rks: &[f32], order: usize) -> Vec<Vec<f32>> {
    (0..order)
        .map(|p| rks.iter().map(|r| r.powi(p as i32)).collect())
        .collect()
}

/// Solves the small dense system `a x = b` in f32 by LU with partial pivoting (as LAPACK's sgesv).
fn solve(a: &[Vec<f32>], b: &[f32]) -> Result<Vec<f32>> {
    let n = b.len();
    let mut a: Vec<Vec<f32>> = a.to_vec();
    let mut x = b.to_vec();
    for col in 0..n {
        let pivot = (col..n)
            .max_by(|&p, &q| {
                a[p][col]
                    .abs()
                    .partial_cmp(&a[q][col].abs())
                    .unwrap_or(std::cmp::Ordering::Equal)
                    // first index wins ties
                    .then(q.cmp(&p))
            })
            .unwrap_or(col);
        // Like LAPACK, only an exact zero pivot is singular; NaN/inf propagate as in torch.
        if a[pivot][col] == 0.0 {
            candle_core::bail!(
                "UniPC: singular coefficient matrix in the corrector/predictor solve"
            );
        }
        a.swap(col, pivot);
        x.swap(col, pivot);
        let inv = 1.0 / a[col][col];
        let (top, bottom) = a.split_at_mut(col + 1);
        let pivot_row = &top[col];
        let (x_top, x_bottom) = x.split_at_mut(col + 1);
        for (row, xr) in bottom.iter_mut().zip(x_bottom.iter_mut()) {
            let l = row[col] * inv;
            for (dst, &p) in row[col + 1..].iter_mut().zip(&pivot_row[col + 1..]) {
                *dst -= l * p;
            }
            *xr -= l * x_top[col];
        }
    }
    for row in (0..n).rev() {
        let mut v = x[row];
        for (&arc, &xc) in a[row][row + 1..].iter().zip(&x[row + 1..]) {
            v -= arc * xc;
        }
        x[row] = v / a[row][row];
    }
    Ok(x)
}

#[cfg(test)]
mod tests {
    use super::solve;

    #[test]
    fn solve_with_pivoting() {
        // [[1, 1], [-3, 1]] x = [1, 5] -> x = [-1, 2]; |-3| > 1 forces a row swap.
        let x = solve(&[vec![1.0, 1.0], vec![-3.0, 1.0]], &[1.0, 5.0]).unwrap();
        assert!(
            (x[0] + 1.0).abs() < 1e-6 && (x[1] - 2.0).abs() < 1e-6,
            "{x:?}"
        );
        let x = solve(
            &[
                vec![2.0, 1.0, 1.0],
                vec![4.0, -6.0, 0.0],
                vec![-2.0, 7.0, 2.0],
            ],
            &[5.0, -2.0, 9.0],
        )
        .unwrap();
        for (g, w) in x.iter().zip([1.0f32, 1.0, 2.0]) {
            assert!((g - w).abs() < 1e-5, "{x:?}");
        }
        assert!(solve(&[vec![1.0, 1.0], vec![1.0, 1.0]], &[1.0, 2.0]).is_err());
    }
}
