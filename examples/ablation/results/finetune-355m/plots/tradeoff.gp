# gnuplot tradeoff.gp (run in this folder) draws tradeoff.svg and .png
svg_out(name) = sprintf('set terminal svg size 900,520 dynamic font "sans,11"; set output "%s.svg"', name)
png_term = strstrt(GPVAL_TERMINALS, 'pngcairo') > 0 ? 'pngcairo' : 'png'
png_out(name) = sprintf('set terminal %s size 900,520; set output "%s.png"', png_term, name)
do for [k = 1:2] {
  eval(k == 1 ? svg_out('tradeoff') : png_out('tradeoff'))
  set title 'Peak memory against speed (red: the Pareto front)'
  set xlabel 'samples/s'
  set ylabel 'peak live MiB'
  set grid
  set key off
  set yrange [0:*]
  plot 'pareto.dat' using 2:3 with linespoints lw 2 pt 7 ps 1.6 linecolor rgb '#cc6677', \
       'tradeoff.dat' using 2:3 with points pt 7 ps 1.2 linecolor rgb '#4477aa', \
       'tradeoff.dat' using 2:3:1 with labels offset 0,0.9 noenhanced font ',9'
}
