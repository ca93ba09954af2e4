//! CPU twins of the CUDA kernels: bf16, blockwise int8, weighted average, fused AdamW.
use gwtf::model::kernels::*;
use gwtf::model::rng::Rng;
use proptest::prelude::*;

#[test]
fn bf16_exact_on_representable_and_rne() {
    // Every bf16 bit pattern that is not NaN round-trips exactly.
    for b in 0..=u16::MAX {
        let x = bf16_to_f32_one(b);
        if x.is_nan() {
            assert!(bf16_to_f32_one(f32_to_bf16_one(x)).is_nan());
        } else {
            assert_eq!(f32_to_bf16_one(x), b, "bits {b:#06x}");
        }
    }
    // Ties go to even: 1 + 2^-8 is halfway between 1 and 1 + 2^-7.
    assert_eq!(f32_to_bf16_one(1.0 + 1.0 / 256.0), f32_to_bf16_one(1.0));
    let odd = bf16_to_f32_one(0x3F81); // 1 + 2^-7 (odd mantissa)
    let tie_up = f32::from_bits(odd.to_bits() + 0x8000); // halfway above the odd value
    assert_eq!(f32_to_bf16_one(tie_up), 0x3F82);
    // Above the halfway point rounds up, below rounds down.
    assert_eq!(f32_to_bf16_one(f32::from_bits(0x3F80_8001)), 0x3F81);
    assert_eq!(f32_to_bf16_one(f32::from_bits(0x3F80_7FFF)), 0x3F80);
    // Specials.
    assert_eq!(f32_to_bf16_one(f32::INFINITY), 0x7F80);
    assert_eq!(f32_to_bf16_one(f32::NEG_INFINITY), 0xFF80);
    assert_eq!(f32_to_bf16_one(-0.0), 0x8000);
    assert!(bf16_to_f32_one(f32_to_bf16_one(f32::NAN)).is_nan());
    // A NaN whose payload lives only in the low bits stays NaN (not inf).
    let nan_low = f32::from_bits(0x7F80_0001);
    assert!(bf16_to_f32_one(f32_to_bf16_one(nan_low)).is_nan());
    assert!(bf16_to_f32_one(f32_to_bf16_one(-nan_low)).is_nan());
    // Overflow rounds to inf.
    assert_eq!(f32_to_bf16_one(f32::MAX), 0x7F80);
}

proptest! {
    #[test]
    fn bf16_roundtrip_error_bound(x in -1e30f32..1e30f32) {
        let y = bf16_to_f32_one(f32_to_bf16_one(x));
        // 8 significant bits, round to nearest: relative error <= half an ulp = 2^-8.
        prop_assert!((x - y).abs() <= x.abs() * (1.0 / 256.0));
    }

    #[test]
    fn int8_roundtrip_error_bound(v in proptest::collection::vec(-100f32..100f32, 1..300), block in 1usize..70) {
        let n = v.len();
        let mut q = vec![0i8; n];
        let mut s = vec![0f32; int8_blocks(n, block)];
        quantize_int8(&mut q, &mut s, &v, block).unwrap();
        let mut d = vec![0f32; n];
        dequantize_int8(&mut d, &q, &s, block).unwrap();
        for (i, (x, y)) in v.iter().zip(&d).enumerate() {
            let sc = s[i / block];
            prop_assert!((x - y).abs() <= sc * 0.5 + sc * 1e-5 + 1e-30, "{} {} scale {}", x, y, sc);
        }
        // The absmax element of every block maps to +-127.
        for (bi, chunk) in v.chunks(block).enumerate() {
            let am = chunk.iter().fold(0f32, |m, x| m.max(x.abs()));
            if am > 0.0 {
                prop_assert!(q[bi * block..bi * block + chunk.len()].iter().any(|&c| c.unsigned_abs() == 127));
            }
        }
    }
}

#[test]
fn int8_specials_and_exactness() {
    // Values k * absmax/127 for integer k are reproduced (up to one rounding of the product).
    let block = 4;
    let x = [
        127.0f32,
        -3.0,
        0.0,
        64.0,
        0.0,
        0.0,
        0.0,
        0.0,
        1.0,
        f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
    ];
    let mut q = vec![0i8; x.len()];
    let mut s = vec![0f32; int8_blocks(x.len(), block)];
    quantize_int8(&mut q, &mut s, &x, block).unwrap();
    assert_eq!(s, vec![1.0, 0.0, 1.0 / 127.0]);
    assert_eq!(&q[..4], &[127, -3, 0, 64]);
    assert_eq!(&q[4..8], &[0, 0, 0, 0], "all-zero block: scale 0, codes 0");
    assert_eq!(
        &q[8..],
        &[127, 0, 127, -127],
        "NaN -> 0, +-inf saturate, excluded from absmax"
    );
    let mut d = vec![0f32; x.len()];
    dequantize_int8(&mut d, &q, &s, block).unwrap();
    assert_eq!(&d[..8], &[127.0, -3.0, 0.0, 64.0, 0.0, 0.0, 0.0, 0.0]);
    // Round to nearest even on ties: 0.5 and 1.5 (in units of scale) -> 0 and 2.
    let x = [127.0f32, 0.5, 1.5, -2.5];
    let mut q = vec![0i8; 4];
    let mut s = vec![0f32; 1];
    quantize_int8(&mut q, &mut s, &x, 4).unwrap();
    assert_eq!(q, vec![127, 0, 2, -2]);
    // Shape errors are errors.
    assert!(quantize_int8(&mut q, &mut s, &x, 0).is_err());
    assert!(quantize_int8(&mut q, &mut [0.0; 2], &x, 4).is_err());
    assert!(dequantize_int8(&mut [0.0; 3], &q, &s, 4).is_err());
}

#[test]
fn weighted_average_matches_f64() {
    let mut r = Rng::new(3);
    let n = 100_003;
    let bufs: Vec<Vec<f32>> = (0..5)
        .map(|_| (0..n).map(|_| r.normal() as f32).collect())
        .collect();
    let w = [1.0f32, 3.0, 0.0, 2.0, 7.0];
    let refs: Vec<&[f32]> = bufs.iter().map(|b| &b[..]).collect();
    let mut out = vec![0f32; n];
    weighted_average(&mut out, &refs, &w).unwrap();
    let tot: f64 = w.iter().map(|&x| x as f64).sum();
    for i in 0..n {
        let e: f64 = (0..5).map(|j| w[j] as f64 * bufs[j][i] as f64).sum::<f64>() / tot;
        assert!((out[i] as f64 - e).abs() <= 1e-6 * (1.0 + e.abs()), "{i}");
    }
    // One input of weight w is the identity; equal inputs average to themselves.
    let mut o1 = vec![0f32; n];
    weighted_average(&mut o1, &refs[..1], &[5.0]).unwrap();
    assert_eq!(o1, bufs[0]);
    assert!(weighted_average(&mut o1, &refs, &[1.0, 1.0]).is_err());
    assert!(weighted_average(&mut o1, &refs[..2], &[1.0, f32::NAN]).is_err());
    assert!(weighted_average(&mut o1, &refs[..2], &[-1.0, 2.0]).is_err());
    assert!(weighted_average(&mut o1, &refs[..2], &[0.0, 0.0]).is_err());
    assert!(weighted_average(&mut o1[..5], &refs[..2], &[1.0, 1.0]).is_err());
}

#[test]
fn adamw_matches_scalar_reference() {
    let mut r = Rng::new(4);
    let n = 50_000;
    let mut p: Vec<f32> = (0..n).map(|_| r.normal() as f32).collect();
    let mut m = vec![0f32; n];
    let mut v = vec![0f32; n];
    let (mut pr, mut mr, mut vr) = (
        p.iter().map(|&x| x as f64).collect::<Vec<_>>(),
        vec![0f64; n],
        vec![0f64; n],
    );
    let opt = AdamW {
        lr: 1e-2,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
    };
    for t in 1..=5u64 {
        let g: Vec<f32> = (0..n).map(|_| r.normal() as f32).collect();
        adamw_update(&mut p, &g, &mut m, &mut v, &opt, t, 0.5, true);
        for i in 0..n {
            let gi = g[i] as f64 * 0.5;
            mr[i] = 0.9 * mr[i] + 0.1 * gi;
            vr[i] = 0.95 * vr[i] + 0.05 * gi * gi;
            let mh = mr[i] / (1.0 - 0.9f64.powi(t as i32));
            let vh = vr[i] / (1.0 - 0.95f64.powi(t as i32));
            pr[i] -= 1e-2 * (mh / (vh.sqrt() + 1e-8) + 0.1 * pr[i]);
        }
    }
    for i in 0..n {
        assert!(
            (p[i] as f64 - pr[i]).abs() < 1e-5 * (1.0 + pr[i].abs()),
            "{i}: {} {}",
            p[i],
            pr[i]
        );
    }
    // Without decay, a zero gradient leaves parameters unchanged.
    let mut p2 = vec![1.0f32; 8];
    let (mut m2, mut v2) = (vec![0f32; 8], vec![0f32; 8]);
    adamw_update(&mut p2, &[0.0; 8], &mut m2, &mut v2, &opt, 1, 1.0, false);
    assert_eq!(p2, vec![1.0; 8]);
}

#[test]
fn bf16_slices_parallel_equal_scalar() {
    let mut r = Rng::new(5);
    let x: Vec<f32> = (0..70_001).map(|_| (r.normal() * 1e3) as f32).collect();
    let mut b = vec![0u16; x.len()];
    f32_to_bf16(&mut b, &x);
    assert!(b.iter().zip(&x).all(|(&b, &x)| b == f32_to_bf16_one(x)));
    let mut y = vec![0f32; x.len()];
    bf16_to_f32(&mut y, &b);
    assert!(y
        .iter()
        .zip(&b)
        .all(|(&y, &b)| y.to_bits() == bf16_to_f32_one(b).to_bits()));
}

#[test]
fn bench_helper_reports_every_kernel() {
    let o = gwtf::model::bench::BenchOptions {
        elements: 1 << 14,
        min_secs: 0.005,
        ..Default::default()
    };
    let r = gwtf::model::bench::cpu_kernels(&o);
    assert_eq!(r.len(), 7);
    assert_eq!(r[0].name, "memcpy");
    assert!(r
        .iter()
        .all(|k| k.gb_per_s > 0.0 && k.calls > 0 && k.secs >= 0.005));
}

#[test]
fn corpus_is_deterministic_english_like() {
    use gwtf::model::data::*;
    let a = generate_corpus(7, 20_000);
    assert_eq!(a, generate_corpus(7, 20_000));
    assert_ne!(a, generate_corpus(8, 20_000));
    assert_eq!(a.len(), 20_000);
    assert!(a.is_ascii());
    assert!(a.contains(". ") && a.contains("the "));
    assert_eq!(detokenize(&tokenize(&a)), a);
}
