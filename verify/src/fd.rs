//! Central finite differences in f64: the independent check of every
//! hand-derived gradient.

use ndarray::ArrayD;

/// `∂f/∂x` by central differences with step `h`, every element of `x`.
pub fn grad(x: &ArrayD<f64>, h: f64, f: impl Fn(&ArrayD<f64>) -> f64) -> ArrayD<f64> {
    let mut xp = x.as_standard_layout().into_owned();
    let mut g = ArrayD::zeros(x.raw_dim());
    for (i, gi) in g.iter_mut().enumerate() {
        let at = |xp: &mut ArrayD<f64>, v: f64| xp.as_slice_mut().expect("standard layout")[i] = v;
        let orig = xp.as_slice().expect("standard layout")[i];
        at(&mut xp, orig + h);
        let fp = f(&xp);
        at(&mut xp, orig - h);
        let fm = f(&xp);
        at(&mut xp, orig);
        *gi = (fp - fm) / (2.0 * h);
    }
    g
}

/// `Σ a·b` over all elements.
pub fn dot(a: &ArrayD<f64>, b: &ArrayD<f64>) -> f64 {
    a.iter().zip(b.iter()).map(|(x, y)| x * y).sum()
}
